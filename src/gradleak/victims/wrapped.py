"""`gradleak.wrap`: any PyTorch policy, audited as it is.

    import gradleak
    victim = gradleak.wrap(model, policy_head="action_net", value_head="value_net",
                           frame_shape=(64, 64, 3))

`model` maps observations to (logits, value) (or pass `forward=fn(model, obs)` that does), or
give separate `actor=` (→ logits) and `critic=` (→ value) modules. The victim keeps the model's
own parameters under their own names, so its gradients are the model's; its roles (which layers
the attacks read) come from the two heads named here and one hooked forward pass. What cannot
be audited is refused, naming the module: a head that is not a biased nn.Linear, a head with a
transform after it, a layer that is stochastic at capture time.

Attacks in the same Python process rebuild it from a copy kept by `wrap`. To audit from the
command line too, say how to rebuild it: `factory="my_package.models:build"`
(a function of no arguments returning the model, in a module loaded with `--plugin
my_package.models`): the capture stores that reference, never code or pickles.
"""

from __future__ import annotations

import copy
import importlib
import sys
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.transform import InputTransform

Forward = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
# models wrapped without a factory, by session key: attacks in the same process rebuild them
_SESSION: dict[str, tuple[nn.Module, Forward | None]] = {}
FEEDS = ("transformed", "frames-chw")  # what the model reads: the network input, or raw frames
# permuted to (N, C, H, W) as float (the model scales them itself, as SB3's policies do)


class ActorCritic(nn.Module):
    """Separate actor (obs → logits) and critic (obs → value) networks as one model."""

    def __init__(self, actor: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.actor, self.critic = actor, critic

    def forward(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs)


def resolve(reference: str, field: str) -> Callable[..., Any]:
    """'package.module:function' → the function. Only gradleak's own modules and modules
    already imported (by --plugin, an entry point or the user's script) are looked in: a
    capture file names code, it must not make gradleak import it."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"victim option {field}={reference!r}: expected 'package.module:name'")
    if module_name not in sys.modules and not module_name.startswith("gradleak."):
        raise ConfigError(f"victim option {field}={reference!r}: module {module_name} is not "
                          f"loaded; pass --plugin {module_name} (or register it as a "
                          "gradleak.plugins entry point)")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"victim option {field}={reference!r}: {error}") from None
    if not callable(found):
        raise ConfigError(f"victim option {field}={reference!r} is not callable")
    return found


@register_victim("wrapped")
class WrappedVictim(Victim):
    """A user's model with its roles declared by `gradleak.wrap` (options in the config)."""

    def __init__(self, config: VictimConfig, model: nn.Module | None = None,
                 forward: Forward | None = None) -> None:
        super().__init__()
        options = config.options
        for key in ("policy_head", "value_head", "transform"):
            if key not in options:
                raise ConfigError(f"victim 'wrapped': option {key!r} is missing (build it with "
                                  "gradleak.wrap)")
        self.config = config
        if model is None and options.get("session") in _SESSION:  # wrapped in this process
            template, forward = _SESSION[options["session"]]
            model = copy.deepcopy(template)
        if model is None:
            if not options.get("factory"):
                raise ConfigError("this victim was wrapped from a model object without "
                                  "factory='package.module:function', so it cannot be rebuilt "
                                  "here: wrap it with a factory to audit it outside that script")
            model = resolve(options["factory"], "factory")(**options.get("factory_kwargs", {}))
            if not isinstance(model, nn.Module):
                raise ConfigError(f"factory {options['factory']} returned a "
                                  f"{type(model).__name__}, expected an nn.Module")
        if forward is None and options.get("forward"):
            forward = resolve(options["forward"], "forward")
        if any(True for _ in model.parameters(recurse=False)):
            raise ConfigError(f"{type(model).__name__} holds parameters of its own (not in a "
                              "submodule): move them into a submodule to wrap it")
        seen: set[int] = set()
        for name, child in model.named_children():  # the model's names, once per module
            if id(child) not in seen:
                seen.add(id(child))
                self.add_module(name, child)
        self.__dict__["_model"] = model  # not a submodule: its parameters are already ours
        self.__dict__["_forward"] = forward
        self.policy_head_role = options["policy_head"]
        self.value_head_role = options["value_head"]
        self.goal_input_role = options.get("goal_input")
        self.extra_inputs = ("goal",) if options.get("goal_key") else ()
        self._transform = InputTransform.from_dict(options["transform"],
                                                   "victim option 'transform'")
        if options.get("feed", "transformed") not in FEEDS:
            raise ConfigError(f"victim option feed={options.get('feed')!r}: expected one of "
                              f"{', '.join(FEEDS)}")

    @property
    def input_transform(self) -> InputTransform:
        return self._transform

    @classmethod
    def rebuildable(cls, config: VictimConfig) -> bool:
        return bool(config.options.get("factory")) or config.options.get("session") in _SESSION

    def train(self, mode: bool = True) -> WrappedVictim:
        super().train(mode)
        self.__dict__["_model"].training = mode
        return self

    def observation(self, image: torch.Tensor, goal: torch.Tensor | None) -> Any:
        """What the model reads: the frame as its feed says, in a dict beside the goal if it
        takes dict observations."""
        options = self.config.options
        if options.get("feed", "transformed") == "transformed":
            frames = self._transform.apply(image)
        else:
            frames = image.permute(0, 3, 1, 2).to(
                image.dtype if image.dtype == torch.float64 else torch.float32)
        if not options.get("image_key"):
            return frames
        if options.get("goal_key") and goal is None:
            raise ConfigError(f"the wrapped model reads {options['goal_key']!r} beside the "
                              "frame: pass goals")
        obs = {options["image_key"]: frames}
        if options.get("goal_key"):
            obs[options["goal_key"]] = goal.to(frames.dtype)
        return obs

    def forward(self, image: torch.Tensor, goal: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        model, call = self.__dict__["_model"], self.__dict__["_forward"]
        outputs = call(model, self.observation(image, goal)) if call else model(
            self.observation(image, goal))
        if not (isinstance(outputs, (tuple, list)) and len(outputs) == 2):
            raise ConfigError(f"{type(model).__name__} returned a {type(outputs).__name__}: a "
                              "wrapped model must return (logits, value); pass forward= "
                              "otherwise")
        logits, value = outputs
        return logits, value.reshape(len(logits))


def wrap(model: nn.Module | None = None, *, policy_head: str, value_head: str,
         frame_shape: tuple[int, int, int] | None = None,
         transform: InputTransform | None = None, actor: nn.Module | None = None,
         critic: nn.Module | None = None, forward: Forward | None = None,
         feed: str = "transformed", image_key: str | None = None, goal_key: str | None = None,
         goal_input: str | None = None, factory: str | None = None,
         factory_kwargs: dict[str, Any] | None = None, label: str | None = None) -> Victim:
    """A victim of `model` (or of `actor` and `critic`, whose heads are then named inside each:
    policy_head in the actor, value_head in the critic). Frames are (H, W, C) uint8 as stored;
    `transform` (default: divide by 255) says what the model does to them. The victim is in
    eval mode, its roles found and checked before it is returned."""
    if (model is None) == (actor is None or critic is None):
        raise ConfigError("wrap: pass either model=, or both actor= and critic=")
    if actor is not None:
        model = ActorCritic(actor, critic)
        policy_head, value_head = f"actor.{policy_head}", f"critic.{value_head}"
    if transform is None:
        if frame_shape is None or len(frame_shape) != 3:
            raise ConfigError(f"wrap: frame_shape={frame_shape!r}: give the stored frames' "
                              "(height, width, channels), or a transform")
        transform = InputTransform(*map(int, frame_shape))
    head = model.get_submodule(policy_head) if _has(model, policy_head) else None
    if not isinstance(head, nn.Linear):
        from gradleak.victims.roles import checked_linear

        checked_linear(model, policy_head, "policy head")  # names what is wrong
    if forward is not None and factory is not None and not _importable(forward):
        raise ConfigError("wrap: forward= must be a module-level function when factory= is "
                          "given, so the victim can be rebuilt")
    options = {"policy_head": policy_head, "value_head": value_head,
               "transform": transform.to_dict(), "feed": feed, "image_key": image_key,
               "goal_key": goal_key, "goal_input": goal_input, "factory": factory,
               "factory_kwargs": dict(factory_kwargs or {}), "label": label or
               type(model).__name__,
               "forward": f"{forward.__module__}:{forward.__qualname__}"
               if forward is not None and _importable(forward) else None}
    if factory is None:  # rebuildable in this process only, from a copy of the architecture
        options["session"] = uuid.uuid4().hex
        _SESSION[options["session"]] = (copy.deepcopy(model), forward)
    config = VictimConfig("wrapped", transform.height, head.out_features, options)
    victim = WrappedVictim(config, model, forward).eval()
    try:
        victim.roles()
    except (RuntimeError, TypeError, ValueError) as error:  # the model's own complaint
        raise ConfigError(f"wrap: {options['label']} fails on example frames of the declared "
                          f"shape {transform.frame_shape} (fed as {feed}): "
                          f"{type(error).__name__}: {str(error).splitlines()[0]}") from None
    return victim


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _importable(function: Callable[..., Any]) -> bool:
    module = sys.modules.get(getattr(function, "__module__", ""), None)
    return module is not None and getattr(module, function.__qualname__, None) is function
