"""L-BFGS over a batch of independent problems, each with its own curvature history.

torch.optim.LBFGS treats all its parameters as one problem: stacking many frames into it
would couple them through one history and one step size. This is the same algorithm
(torch's two-loop recursion, fixed step `lr`, no line search, the same stopping rules), run
for B problems side by side; a test checks it against torch.optim.LBFGS problem by problem.
"""

from __future__ import annotations

import torch


class BatchedLBFGS:
    """Call `step(x, loss, grad)` once per iteration with the loss and gradient at x."""

    def __init__(self, batch: int, dim: int, lr: float = 1.0, history: int = 100,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9,
                 dtype: torch.dtype = torch.float32) -> None:
        self.lr, self.history = lr, history
        self.tolerance_grad, self.tolerance_change = tolerance_grad, tolerance_change
        self.steps = torch.zeros(batch, history, dim, dtype=dtype)  # s_k = x_{k+1} − x_k
        self.changes = torch.zeros(batch, history, dim, dtype=dtype)  # y_k = g_{k+1} − g_k
        self.rho = torch.zeros(batch, history, dtype=dtype)
        self.count = torch.zeros(batch, dtype=torch.long)  # accepted pairs, at most `history`
        self.head = torch.zeros(batch, dtype=torch.long)  # the ring slot written next
        self.h_diag = torch.ones(batch, dtype=dtype)
        self.active = torch.ones(batch, dtype=torch.bool)
        self.iteration = 0
        self.direction = torch.zeros(batch, dim, dtype=dtype)
        self.t = torch.zeros(batch, dtype=dtype)
        self.previous_grad: torch.Tensor | None = None
        self.previous_loss: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, x: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(B, n) x → the next iterate; converged problems stay where they are."""
        self._check_convergence(loss, grad)
        self.iteration += 1
        if self.iteration == 1:
            direction = -grad
        else:
            self._remember(grad - self.previous_grad, self.direction * self.t[:, None])
            direction = self._two_loop(grad)
        self.previous_grad, self.previous_loss = grad.clone(), loss.clone()
        if self.iteration == 1:
            t = torch.clamp(1.0 / grad.abs().sum(1), max=1.0) * self.lr
        else:
            t = torch.full_like(self.t, self.lr)
        descent = (grad * direction).sum(1) <= -self.tolerance_change
        self.active &= descent
        self.direction = torch.where(self.active[:, None], direction, self.direction)
        self.t = torch.where(self.active, t, self.t)
        return torch.where(self.active[:, None], x + self.t[:, None] * direction, x)

    def _check_convergence(self, loss: torch.Tensor, grad: torch.Tensor) -> None:
        optimal = grad.abs().amax(1) <= self.tolerance_grad
        if self.iteration > 0:
            optimal |= (self.direction * self.t[:, None]).abs().amax(1) <= self.tolerance_change
            optimal |= (loss - self.previous_loss).abs() < self.tolerance_change
        self.active &= ~optimal

    def _remember(self, y: torch.Tensor, s: torch.Tensor) -> None:
        ys = (y * s).sum(1)
        accept = self.active & (ys > 1e-10)
        rows = torch.nonzero(accept).squeeze(1)
        slots = self.head[rows]
        self.changes[rows, slots] = y[rows]
        self.steps[rows, slots] = s[rows]
        self.rho[rows, slots] = 1.0 / ys[rows]
        self.h_diag[rows] = ys[rows] / (y[rows] * y[rows]).sum(1)
        self.head[rows] = (slots + 1) % self.history
        self.count[rows] = torch.clamp(self.count[rows] + 1, max=self.history)

    def _two_loop(self, grad: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(grad))
        q = -grad
        newest_first = []
        for k in range(int(self.count.max())):
            slot = (self.head - 1 - k) % self.history
            valid = (k < self.count).to(grad.dtype)
            alpha = (self.steps[rows, slot] * q).sum(1) * self.rho[rows, slot] * valid
            q = q - alpha[:, None] * self.changes[rows, slot]
            newest_first.append((slot, valid, alpha))
        r = q * self.h_diag[:, None]
        for slot, valid, alpha in reversed(newest_first):
            beta = (self.changes[rows, slot] * r).sum(1) * self.rho[rows, slot] * valid
            r = r + (alpha - beta)[:, None] * self.steps[rows, slot]
        return r
