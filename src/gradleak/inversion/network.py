"""What the walk reads of a network: its modules by name and the roles of its conv stack.

A `Victim` (an RL policy) is one; `gradleak.fedavg` wraps a client's classifier as one. The
roles come from one recorded forward pass (`gradleak.victims.roles`): the conv stack's modules
in call order, whether composing them gives what the Linear reading them receives, and that
Linear's name.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from gradleak.victims.roles import ConvStep


class ConvStackRoles(Protocol):
    """The roles the walk reads (`victims.roles.Roles` and `.StackRoles` have them)."""

    @property
    def conv_stack(self) -> tuple[ConvStep, ...]: ...

    @property
    def conv_chain(self) -> bool: ...

    @property
    def feature_linear(self) -> str | None: ...


class Network(Protocol):
    """A model the walk can descend: its roles, its modules, and how messages name it."""

    @property
    def label(self) -> str: ...

    def roles(self) -> ConvStackRoles: ...

    def get_submodule(self, target: str) -> nn.Module: ...
