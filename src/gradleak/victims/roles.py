"""What each part of a victim does for the attacks: its roles, found by one forward pass.

An attack never looks a parameter up by a fixed name. It reads a `Roles`: which Linear is the
policy head and which the value head (and whether they read the same features h), which biased
Linear layers are applied once per sample (their input comes out of the gradient in closed
form), which of them reads the flattened frame or the conv stack's output, the conv stack as
the modules it calls in order (and whether composing them really gives that output), the layer
that reads a recurrent state or a goal vector, and the input transform from stored frames to
what the first layer reads. The victim names its two heads (and the recurrent and goal layers);
everything else is discovered here by hooking every leaf module during one forward pass on
example inputs, then checked against that pass. The capture stores the result (attribute
`roles`), and readers check it against the layer table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.transform import InputTransform

# conv-stack module kinds the recursion through the conv stack knows how to pass (or refuse)
KINDS = {nn.Conv2d: "conv", nn.ReLU: "relu", nn.BatchNorm2d: "batchnorm",
         nn.MaxPool2d: "maxpool", nn.GroupNorm: "groupnorm", nn.Flatten: "flatten"}
STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout)


@dataclass(frozen=True)
class ConvStep:
    """One module the conv stack calls, in call order, with the shape it reads. A ReLU the
    forward code applies as a function (`F.relu`, `torch.relu`) between two modules is a step
    too, `functional`, named after the module it follows ("conv1:relu")."""

    module: str
    kind: str  # a KINDS value, or the module's class name in lower case
    input_shape: tuple[int, ...]  # per sample, e.g. (C, H, W)
    functional: bool = False


@dataclass(frozen=True)
class Roles:
    policy_head: str
    value_head: str
    shared_features: bool  # both heads read the same h (one network), or not (actor ≠ critic)
    linears: tuple[str, ...]  # biased Linear layers applied once per sample, in call order
    transform: InputTransform
    conv_stack: tuple[ConvStep, ...] = ()
    conv_chain: bool = False  # composing conv_stack in order gives feature_linear's input
    feature_linear: str | None = None  # the Linear reading the flattened conv-stack output
    frame_linear: str | None = None  # a Linear reading the flattened (transformed) frame
    recurrent_state: str | None = None  # the Linear reading the pre-step hidden state
    goal_input: str | None = None  # the Linear reading the goal vector
    extra_inputs: tuple[str, ...] = ()
    nonnegative_features: bool = True  # h ≥ 0 on the example pass (after a ReLU)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: Any, source: str) -> Roles:
        try:
            data = json.loads(text)
            steps = tuple(ConvStep(str(s["module"]), str(s["kind"]),
                                   tuple(int(n) for n in s["input_shape"]),
                                   bool(s.get("functional", False)))
                          for s in data.get("conv_stack", ()))
            transform = InputTransform.from_dict(data["transform"], f"{source}: transform")
            roles = cls(**{**data, "conv_stack": steps, "transform": transform,
                           "linears": tuple(data["linears"]),
                           "extra_inputs": tuple(data.get("extra_inputs", ()))})
        except (TypeError, ValueError, KeyError) as error:
            raise ConfigError(f"{source}: not a roles table ({type(error).__name__}: {error})"
                              ) from None
        if not isinstance(roles.policy_head, str) or roles.policy_head not in roles.linears:
            raise ConfigError(f"{source}: the policy head {roles.policy_head!r} is not one of "
                              "its closed-form Linear layers")
        return roles

    def conv_modules(self) -> list[str]:
        return [step.module for step in self.conv_stack if not step.functional]

    def component_of(self, parameter: str) -> str:
        """'cnn' for the conv stack, 'heads' for the two heads, 'fc' for everything else."""
        module = parameter.rsplit(".", 1)[0]
        if module in (self.policy_head, self.value_head):
            return "heads"
        return "cnn" if module in self.conv_modules() else "fc"

    def check_layers(self, shapes: dict[str, tuple[int, ...]], num_actions: int, source: str
                     ) -> None:
        """Every role layer present in a layer table (name → shape) has the shape it must."""
        for module in (*self.linears, self.feature_linear, self.frame_linear,
                       self.recurrent_state, self.goal_input):
            shape = shapes.get(f"{module}.weight")
            if module is not None and shape is not None and len(shape) != 2:
                raise ConfigError(f"{source}: role layer {module} has a weight of shape "
                                  f"{shape}, expected a Linear layer's (out, in)")
        policy = shapes.get(f"{self.policy_head}.weight")
        if policy is not None and policy[0] != num_actions:
            raise ConfigError(f"{source}: policy head {self.policy_head} has {policy[0]} outputs"
                              f", expected the {num_actions} actions")


@dataclass
class _Call:
    name: str
    module: nn.Module
    input: torch.Tensor | None
    output: torch.Tensor | None


def _record_calls(model: nn.Module, run: Callable[[], Any]) -> tuple[list[_Call], Any]:
    """Every leaf module call (and the heads, leaf or not) in order, with its first tensor
    input and its tensor output, each copied when the call sees it: an in-place module after
    it (`nn.ReLU(inplace=True)`) would otherwise rewrite what was recorded."""
    calls: list[_Call] = []
    inputs: dict[int, list[torch.Tensor | None]] = {}
    handles = []
    for name, module in model.named_modules():
        if name and not any(True for _ in module.children()):
            def before(mod: nn.Module, args: tuple) -> None:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                inputs.setdefault(id(mod), []).append(
                    None if first is None else first.detach().clone())

            def hook(mod: nn.Module, args: tuple, output: Any, name: str = name) -> None:
                calls.append(_Call(name, mod, inputs[id(mod)].pop(),
                                   output.detach().clone() if isinstance(output, torch.Tensor)
                                   else None))
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    return calls, result


def checked_linear(model: nn.Module, name: str, role: str, needs_bias: bool = True) -> nn.Linear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ConfigError(f"{role} {name!r}: no such module (its Linear layers are "
                          f"{', '.join(linears) or 'none'})") from None
    if not isinstance(module, nn.Linear):
        raise ConfigError(f"{role} {name!r} is a {type(module).__name__}: the closed form needs "
                          "an nn.Linear layer there")
    if needs_bias and module.bias is None:
        raise ConfigError(f"{role} {name!r} has no bias: its input cannot be recovered from "
                          "its gradient (x = ∇Wᵀ∇b / ‖∇b‖² needs ∇b)")
    return module


def _check_deterministic(first: list[_Call], second: list[_Call]) -> None:
    """Two passes on the same input must agree, module by module: the first that does not
    is named."""
    for a, b in zip(first, second, strict=False):
        if isinstance(a.module, STOCHASTIC) and a.module.p > 0 and a.module.training:
            raise ConfigError(f"module {a.name} ({type(a.module).__name__}) is stochastic at "
                              "capture time: put the model in eval mode (model.eval())")
        if not _same(a.input, b.input):
            raise ConfigError(f"module {a.name} reads different inputs on two passes over the "
                              "same frames: something stochastic runs before it (in the "
                              "model's forward code); a stochastic model cannot be audited")
        if not _same(a.output, b.output):
            raise ConfigError(f"module {a.name} ({type(a.module).__name__}) gives different "
                              "outputs for the same input: a stochastic layer cannot be audited "
                              "(evaluate it deterministically at capture time)")


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None or b is None or torch.equal(a, b)


def _conv_stack(calls: list[_Call]) -> tuple[list[_Call], int]:
    """The calls from the first Conv2d up to the first Linear after it, and that index."""
    first = next((i for i, c in enumerate(calls) if isinstance(c.module, nn.Conv2d)), None)
    if first is None:
        return [], -1
    end = next((i for i in range(first, len(calls)) if isinstance(calls[i].module, nn.Linear)),
               len(calls))
    return calls[first:end], end


def _composed_steps(stack: list[_Call], target: torch.Tensor) -> list[ConvStep] | None:
    """The stack's steps when running its modules one after another gives `target`
    (flattened), each reading what the one before it gave, or that after a ReLU the forward
    code applies as a function (a step marked `functional`); None otherwise: a branch beside
    them (a projected skip connection) or another operation between them that is no module."""
    steps: list[ConvStep] = []
    x = stack[0].input.clone()  # an in-place module must not rewrite the record
    with torch.no_grad():
        for number, call in enumerate(stack + [None]):
            wanted = target if call is None else call.input
            seen = x.flatten(1) if call is None else x
            if not _close(seen, wanted):
                if not number or not _close(torch.relu(seen), wanted):
                    return None
                steps.append(ConvStep(f"{stack[number - 1].name}:relu", "relu",
                                      tuple(x.shape[1:]), functional=True))
                x = torch.relu(x)
            if call is None:
                return steps
            steps.append(ConvStep(call.name, KINDS.get(type(call.module),
                                                       type(call.module).__name__.lower()),
                                  tuple(call.input.shape[1:])))
            x = call.module(x)
    return None


@dataclass(frozen=True)
class StackRoles:
    """The conv-stack roles of any model (a classifier as much as a policy): the walk's input
    (`gradleak.inversion.network`)."""

    conv_stack: tuple[ConvStep, ...]
    conv_chain: bool  # composing conv_stack in order gives feature_linear's input
    feature_linear: str | None  # the Linear reading the flattened conv-stack output
    linears: tuple[str, ...]  # biased Linear layers applied once per sample, in call order


def discover_stack(model: nn.Module, run: Callable[[], Any], network_input: torch.Tensor,
                   source: str = "the model's input") -> StackRoles:
    """The conv-stack roles of `model` from a forward pass `run()` on `network_input` (N ≥ 2,
    what its first layer reads). Raises ConfigError naming a stochastic module."""
    calls, _ = _record_calls(model, run)
    again, _ = _record_calls(model, run)
    _check_deterministic(calls, again)
    return _stack_roles(calls, network_input, source)


def _stack_roles(calls: list[_Call], network_input: torch.Tensor, source: str) -> StackRoles:
    counts: dict[str, int] = {}
    for call in calls:
        counts[call.name] = counts.get(call.name, 0) + 1
    linears = tuple(dict.fromkeys(
        c.name for c in calls if isinstance(c.module, nn.Linear) and c.module.bias is not None
        and counts[c.name] == 1 and c.input is not None and c.input.dim() == 2))
    stack, end = _conv_stack(calls)
    if stack and not torch.allclose(stack[0].input, network_input, rtol=1e-5, atol=1e-6):
        raise ConfigError(f"{source} does not give what {stack[0].name} reads: declare the "
                          "model's own preprocessing")
    feature_linear = calls[end].name if stack and end < len(calls) and \
        calls[end].name in linears else None
    composed = None if feature_linear is None else _composed_steps(stack, calls[end].input)
    steps = tuple(composed) if composed is not None else tuple(
        ConvStep(c.name, KINDS.get(type(c.module), type(c.module).__name__.lower()),
                 tuple(c.input.shape[1:])) for c in stack)
    return StackRoles(steps, composed is not None, feature_linear, linears)


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def discover(model: nn.Module, run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
             frames: torch.Tensor, transform: InputTransform, *, policy_head: str,
             value_head: str, recurrent_state: str | None = None,
             goal_input: str | None = None, extra_inputs: tuple[str, ...] = ()) -> Roles:
    """Roles of `model`, from a forward pass `run()` → (logits, value) on example `frames`
    (N ≥ 2, stored format). Raises ConfigError naming the module that cannot be audited."""
    policy = checked_linear(model, policy_head, "policy head")
    value = checked_linear(model, value_head, "value head")
    for name, role in ((recurrent_state, "recurrent state layer"), (goal_input, "goal layer")):
        if name is not None:
            checked_linear(model, name, role)
    calls, (logits, values) = _record_calls(model, run)
    again, _ = _record_calls(model, run)
    _check_deterministic(calls, again)
    by_module: dict[str, list[_Call]] = {}
    for call in calls:
        by_module.setdefault(call.name, []).append(call)
    for name, head, width in ((policy_head, policy, logits.shape[-1]), (value_head, value, 1)):
        if len(by_module.get(name, ())) != 1:
            raise ConfigError(f"{name} is called {len(by_module.get(name, ()))} times in one "
                              "forward pass: a head is applied once per sample")
        if head.out_features != width:
            raise ConfigError(f"{name} has {head.out_features} outputs, but the model's "
                              f"{'logits' if head is policy else 'value'} have {width}")
    policy_call, value_call = by_module[policy_head][0], by_module[value_head][0]
    if not torch.equal(policy_call.output, logits.detach()):
        raise ConfigError(f"{policy_head}'s output is not the model's logits: the policy head "
                          "must be the last layer (no transform after it)")
    network_input = transform.apply(frames)
    stack = _stack_roles(calls, network_input, f"the declared input transform ({transform})")
    flat = network_input.flatten(1)
    frame_linear = next((c.name for c in calls if c.name in stack.linears and c.input.shape ==
                         flat.shape and torch.allclose(c.input, flat, rtol=1e-5, atol=1e-6)),
                        None)
    return Roles(policy_head=policy_head, value_head=value_head,
                 shared_features=torch.equal(policy_call.input, value_call.input),
                 linears=stack.linears, transform=transform, conv_stack=stack.conv_stack,
                 conv_chain=stack.conv_chain, feature_linear=stack.feature_linear,
                 frame_linear=frame_linear,
                 recurrent_state=recurrent_state, goal_input=goal_input,
                 extra_inputs=extra_inputs,
                 nonnegative_features=not bool((policy_call.input < 0).any()))

