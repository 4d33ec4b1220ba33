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
command line too, say how to rebuild it: `factory="my-policy"`, the name of a function
registered with `@gradleak.register_model_factory("my-policy")` in a module loaded with
`--plugin my_package.models` (with `factory_kwargs`, JSON its signature accepts). The capture
stores that name, never code or pickles; a name that is not registered is refused before any
call (`victims/factories.py`).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError
from gradleak.victims.base import Victim, VictimConfig, register_victim
from gradleak.victims.factories import FORWARDS, MODEL_FACTORIES, Named, find, name_of
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


def rebuild_entries(options: dict[str, Any]) -> tuple[Named, dict[str, Any], Named | None]:
    """The registered factory a victim's options name, its checked arguments, and the
    registered forward function if one is named: every name checked before anything is
    called."""
    factory = find(MODEL_FACTORIES, options["factory"], "victim option factory")
    kwargs = factory.arguments(options.get("factory_kwargs") or {},
                               "victim option factory_kwargs")
    forward = find(FORWARDS, options["forward"], "victim option forward") \
        if options.get("forward") else None
    return factory, kwargs, forward


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
                raise ConfigError("this victim was wrapped from a model object without a "
                                  "registered factory=, so it cannot be rebuilt here: wrap it "
                                  "with one to audit it outside that script")
            factory, kwargs, named_forward = rebuild_entries(options)
            model = factory.function(**kwargs)
            if not isinstance(model, nn.Module):
                raise ConfigError(f"factory {factory.name!r} returned a "
                                  f"{type(model).__name__}, expected an nn.Module")
            if forward is None and named_forward is not None:
                forward = named_forward.function
        seen: set[int] = set()
        for name, child in model.named_children():  # the model's names, once per module
            if id(child) not in seen:
                seen.add(id(child))
                self.add_module(name, child)
        # its own tensors too (a ViT's position embedding and class token), the same objects
        for name, parameter in model.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer,
                                 persistent=name not in model._non_persistent_buffers_set)
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
        """A model wrapped in this process, or one whose factory is registered here (a named
        factory that is not is refused, naming it)."""
        if config.options.get("session") in _SESSION:
            return True
        if not config.options.get("factory"):
            return False
        rebuild_entries(config.options)
        return True

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
        with own_tensors_of(self, model):
            outputs = call(model, self.observation(image, goal)) if call else model(
                self.observation(image, goal))
        if not (isinstance(outputs, (tuple, list)) and len(outputs) == 2):
            raise ConfigError(f"{type(model).__name__} returned a {type(outputs).__name__}: a "
                              "wrapped model must return (logits, value); pass forward= "
                              "otherwise")
        logits, value = outputs
        return logits, value.reshape(len(logits))


@contextmanager
def own_tensors_of(victim: nn.Module, model: nn.Module) -> Iterator[None]:
    """The model's own parameters and buffers (not in a submodule) read through the victim's
    for one call: the per-step gradients substitute the victim's tensors by name
    (`torch.func.functional_call`), and the model must see the substitutes."""
    own = [(store, name) for store in ("_parameters", "_buffers")
           for name in getattr(model, store) if getattr(model, store)[name] is not None]
    saved = [getattr(model, store)[name] for store, name in own]
    for store, name in own:
        getattr(model, store)[name] = getattr(victim, store)[name]
    try:
        yield
    finally:
        for (store, name), tensor in zip(own, saved, strict=True):
            getattr(model, store)[name] = tensor


def wrap(model: nn.Module | None = None, *, policy_head: str, value_head: str,
         frame_shape: tuple[int, int, int] | None = None,
         transform: InputTransform | None = None, actor: nn.Module | None = None,
         critic: nn.Module | None = None, forward: Forward | None = None,
         feed: str = "transformed", image_key: str | None = None, goal_key: str | None = None,
         goal_input: str | None = None, factory: str | Callable[..., nn.Module] | None = None,
         factory_kwargs: dict[str, Any] | None = None, label: str | None = None) -> Victim:
    """A victim of `model` (or of `actor` and `critic`, whose heads are then named inside each:
    policy_head in the actor, value_head in the critic). Frames are (H, W, C) uint8 as stored;
    `transform` (default: divide by 255) says what the model does to them. `factory` (a
    registered model factory, by name or the function itself) rebuilds the architecture from
    a capture in another process; a `forward` is then registered too. The victim is in eval
    mode, its roles found and checked before it is returned."""
    if (model is None) == (actor is None or critic is None):
        raise ConfigError("wrap: pass either model=, or both actor= and critic=")
    for name, module in (("model", model), ("actor", actor), ("critic", critic)):
        if module is not None and not isinstance(module, nn.Module):
            raise ConfigError(f"wrap: {name}= is a {type(module).__name__}, expected a "
                              "torch.nn.Module")
    if forward is not None and not callable(forward):
        raise ConfigError(f"wrap: forward= is a {type(forward).__name__}, expected a function "
                          "(model, observation) -> (logits, value)")
    factory_name, forward_name = _registered_names(factory, factory_kwargs, forward)
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
    options = {"policy_head": policy_head, "value_head": value_head,
               "transform": transform.to_dict(), "feed": feed, "image_key": image_key,
               "goal_key": goal_key, "goal_input": goal_input, "factory": factory_name,
               "factory_kwargs": dict(factory_kwargs or {}), "label": label or
               type(model).__name__, "forward": forward_name}
    if factory_name is None:  # rebuildable in this process only, from a copy of the architecture
        options["session"] = uuid.uuid4().hex
        _SESSION[options["session"]] = (copy.deepcopy(model), forward)
    # int(): a head built from a NumPy count (gymnasium's `action_space.n` is np.int64)
    config = VictimConfig("wrapped", transform.height, int(head.out_features), options)
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


def _registered_names(factory: str | Callable[..., nn.Module] | None,
                      factory_kwargs: dict[str, Any] | None, forward: Forward | None
                      ) -> tuple[str | None, str | None]:
    """The names a capture will hold for `factory` and `forward`, checked as a reader checks
    them: registered, and the factory's arguments fit its signature."""
    forward_name = name_of(FORWARDS, forward) if forward is not None else None
    if factory is None:
        if factory_kwargs:
            raise ConfigError("wrap: factory_kwargs= without factory=")
        return None, forward_name
    if callable(factory):
        name = name_of(MODEL_FACTORIES, factory)
        if name is None:
            raise ConfigError(f"wrap: factory={getattr(factory, '__qualname__', factory)!r} is "
                              "not registered: decorate it with "
                              "@gradleak.register_model_factory(NAME)")
        factory = name
    entry = find(MODEL_FACTORIES, factory, "wrap: factory")
    entry.arguments(factory_kwargs or {}, "wrap: factory_kwargs")
    if forward is not None and forward_name is None:
        raise ConfigError(f"wrap: forward={getattr(forward, '__qualname__', forward)!r} is not "
                          "registered, so a capture could not rebuild the victim with it: "
                          "decorate it with @gradleak.register_forward(NAME)")
    return entry.name, forward_name
