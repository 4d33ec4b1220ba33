"""Audit every client of a Flower run: `pip install gradleak[flower]` (Flower >= 1.21's Message
API: a ServerApp's strategy with configure_train / aggregate_train).

    from flwr.serverapp.strategy import FedAvg
    from gradleak.integrations.flower import AuditStrategy
    from gradleak.fedavg import Normalize

    strategy = AuditStrategy(FedAvg(fraction_train=1.0), model_fn=Net, shape=(1, 28, 28),
                             input_transform=Normalize(0.5, 0.5), methods=("sme",),
                             hyperparameters={"local-epochs": 1, "batch-size": 32},
                             out="runs/flower-audit")
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=3,
                   train_config=ConfigRecord({"lr": 0.05}))

It keeps the arrays each client was sent (configure_train) and, from each reply
(aggregate_train), writes the client's update file atomically (`updates/round-R/node-N.
safetensors`, the format `gradleak fedavg-invert` reads) and hands the inversion to a worker
process, so the round goes on at once; the wrapped strategy aggregates exactly what it would
have. `start` (or `finish()`, for servers that drive rounds themselves) waits for the workers
and writes `report.html` and `audit.json`. The server sees only what Flower delivers: a client's
mods (clipping, LocalDpMod) act before that, and the audit measures what they leave.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.errors import ConfigError

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy
except ImportError as error:  # pragma: no cover - the extra is installed in CI
    raise ConfigError("gradleak.integrations.flower needs Flower >= 1.21: pip install "
                      f"'gradleak[flower]' ({error})") from None

from gradleak.fedavg.audit import AuditOptions, Truth, audit_update, summarise
from gradleak.fedavg.forward import identity
from gradleak.fedavg.invert import Training, counted_steps, inference_gap
from gradleak.fedavg.update_file import write_update
from gradleak.fedavg.walk import plan_walk
from gradleak.io import owned_folder, write_json
from gradleak.names import TRAINING_FREE
from gradleak.victims.factories import MODEL_FACTORIES, find, name_of

AUDIT_FORMAT = "gradleak-flower-audit"
TruthFn = Callable[[int, Message], Truth | None]


def _picklable(value: Any, name: str) -> None:
    try:
        pickle.dumps(value)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ConfigError(f"{name} must be picklable (a module-level class or function, not a "
                          f"lambda or a local): the audit runs in a worker process ({error})"
                          ) from None


def _fits(model: nn.Module, shape: tuple[int, ...], transform: Any) -> None:
    """The model takes a batch of `shape` images (after `transform`) and returns logits (B, K):
    checked here, not in the first round, where it would stop the whole federation."""
    images = torch.rand(2, *shape)
    try:
        with torch.no_grad():
            logits = model.eval()(transform(images) if transform is not None else images)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ConfigError(f"shape={shape}: model_fn's {type(model).__name__} fails on images of "
                          f"that shape ({type(error).__name__}: {str(error).splitlines()[0]})"
                          ) from None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or len(logits) != 2:
        raise ConfigError(f"model_fn's {type(model).__name__} returns "
                          f"{getattr(logits, 'shape', type(logits).__name__)} for 2 images of "
                          f"shape {shape}; expected logits (2, classes)")


def _node_ids(clients: Any) -> bool:
    """Is `clients` a non-empty collection of node ids (not a string)?"""
    if isinstance(clients, (str, bytes)) or not isinstance(clients, Iterable):
        return False
    ids = list(clients)
    return bool(ids) and all(isinstance(n, int) and not isinstance(n, bool) for n in ids)


def registered_model(model_fn: Callable[[], nn.Module], name: str | None) -> str | None:
    """The registered factory name the update files give `fedavg-invert` (None: model_fn is
    not registered, so only this process can rebuild the model)."""
    if name is None:
        return name_of(MODEL_FACTORIES, model_fn)
    find(MODEL_FACTORIES, name, "model_ref").arguments({}, "model_ref")
    return name


class AuditStrategy(Strategy):
    """Wraps a Flower strategy; every `every`-th round, audits the chosen clients' updates."""

    def __init__(self, strategy: Strategy, *, model_fn: Callable[[], nn.Module],
                 shape: tuple[int, ...], out: str | Path, input_transform: Any = None,
                 methods: Iterable[str] = ("sme",), every: int = 1,
                 clients: int | Iterable[int] | None = None, batchnorm: str = "train",
                 hyperparameters: dict[str, Any] | None = None, iterations: int = 1000,
                 labels: str = "infer", workers: int = 1, truth: TruthFn | None = None,
                 reference: torch.Tensor | None = None, model_ref: str | None = None,
                 options: AuditOptions | None = None,
                 reference_labels: torch.Tensor | None = None) -> None:
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"AuditStrategy wraps a flwr.serverapp.strategy.Strategy, got "
                              f"{type(strategy).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every={every!r}: expected a round interval >= 1")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"workers={workers!r}: expected >= 0 (0 audits in this process, "
                              "on the round's critical path)")
        if not (isinstance(shape, (tuple, list)) and len(shape) == 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
            raise ConfigError(f"shape={shape!r}: expected (C, H, W) of one image, positive "
                              "integers, e.g. (1, 28, 28)")
        if input_transform is not None and not callable(input_transform):
            raise ConfigError(f"input_transform={input_transform!r}: expected None or a "
                              "callable on image batches, e.g. gradleak.fedavg.Normalize(0.5, "
                              "0.5)")
        if not (clients is None or (isinstance(clients, int) and not isinstance(clients, bool)
                                    and clients >= 1) or _node_ids(clients)):
            raise ConfigError(f"clients={clients!r}: expected None (every client), a count "
                              ">= 1, or node ids (integers)")
        if batchnorm not in ("train", "eval"):
            raise ConfigError(f"batchnorm={batchnorm!r}: expected the mode the clients trained "
                              "BatchNorm in, train or eval")
        self.options = options or AuditOptions(methods=tuple(methods), iterations=iterations,
                                               batchnorm=batchnorm, labels=labels)
        self.options.check()
        if self.options.labels == "known" and truth is None:
            raise ConfigError("labels='known' needs truth= (the clients' true labels)")
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model_fn returned a {type(model).__name__}, expected an "
                              "nn.Module")
        _fits(model, tuple(shape), input_transform)
        if TRAINING_FREE in self.options.methods:  # the architecture, before any round
            plan_walk(model, tuple(shape), input_transform or identity, 1, None,
                      (hyperparameters or {}).get("optimiser"),
                      self.options.batchnorm or batchnorm)
        if workers:
            _picklable(model_fn, "model_fn")
            _picklable(input_transform, "input_transform")
        self.strategy, self.model_fn, self.shape = strategy, model_fn, tuple(shape)
        self.input_transform, self.every, self.workers = input_transform, every, workers
        self.clients = clients if clients is None or isinstance(clients, int) \
            else frozenset(clients)
        self.batchnorm, self.truth, self.reference = batchnorm, truth, reference
        if reference_labels is not None and (reference is None or len(reference_labels)
                                             != len(reference)):
            raise ConfigError("reference_labels: one label per reference image (the class-mean "
                              "row), and reference= given")
        self.reference_labels = reference_labels
        if self.options.attack.get("start") == "class-mean" and (
                reference_labels is None or tuple(reference.shape[1:]) != tuple(shape)):
            raise ConfigError("start 'class-mean' begins from each label's mean auxiliary "
                              "image: give reference= images of shape "
                              f"(M, {', '.join(map(str, shape))}) with reference_labels=")
        if "separate" in self.options.methods and (
                reference is None or tuple(reference.shape[1:]) != tuple(shape)):
            raise ConfigError(f"method 'separate' starts from auxiliary images of the task: "
                              f"give reference= images of shape (M, {', '.join(map(str, shape))})")
        self.hyperparameters = dict(hyperparameters or {})
        self.model_ref = registered_model(model_fn, model_ref)
        self.out = self._claim(Path(out))
        self._sent: dict[tuple[int, int], tuple[ArrayRecord, dict[str, Any]]] = {}
        self._jobs: list[tuple[dict[str, Any], Future | list[dict[str, Any]]]] = []
        self._failures: list[dict[str, Any]] = []
        self._pool: ProcessPoolExecutor | None = None

    def _claim(self, out: Path) -> Path:
        """An empty or new folder, or one this audit class wrote before (never a user's)."""
        owned_folder(out, "audit.json", AUDIT_FORMAT, "out", "a Flower audit")
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "audit.json", {"format": AUDIT_FORMAT, "status": "running"})
        return out

    # --- Flower's Strategy interface, delegated --------------------------------------------
    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if (server_round - 1) % self.every == 0:
            chosen = sorted(m.metadata.dst_node_id for m in messages)
            if isinstance(self.clients, int):
                chosen = chosen[:self.clients]
            elif self.clients is not None:
                chosen = [n for n in chosen if n in self.clients]
            for message in messages:
                if message.metadata.dst_node_id in chosen:
                    sent = single(message.content.array_records, "sent", "ArrayRecord")
                    configs = message.content.config_records
                    settings = dict(next(iter(configs.values()))) if configs else {}
                    self._sent[(server_round, message.metadata.dst_node_id)] = (sent, settings)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        for reply in replies:
            key = (server_round, reply.metadata.src_node_id)
            if key in self._sent and not reply.has_error():
                self._record(server_round, reply, *self._sent.pop(key))
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def start(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().start(*args, **kwargs)
        finally:
            self.finish()

    # --- the audit ------------------------------------------------------------------------
    def _record(self, server_round: int, reply: Message, sent: ArrayRecord,
                settings: dict[str, Any]) -> None:
        node = reply.metadata.src_node_id
        received = single(reply.content.array_records, f"node {node}'s reply", "ArrayRecord")
        metrics = {k: v for record in reply.content.metric_records.values()
                   for k, v in record.items()}
        examples = metrics.get(getattr(self.strategy, "weighted_by_key", "num-examples"),
                               metrics.get("num-examples"))
        if not isinstance(examples, int) or examples < 1:
            raise ConfigError(f"node {node}'s reply has no 'num-examples' metric: the audit "
                              "needs the client's example count")
        path = self.out / "updates" / f"round-{server_round:03d}" / f"node-{node}.safetensors"
        meta = {"round": server_round, "node_id": int(node), "num_examples": examples,
                "config": jsonable(settings), "metrics": jsonable(metrics),
                "hyperparameters": jsonable(self.hyperparameters), "shape": list(self.shape),
                "input_transform": getattr(self.input_transform, "to_dict", lambda: None)(),
                "batchnorm": self.batchnorm, "model": self.model_ref}
        before, after = sent.to_torch_state_dict(), received.to_torch_state_dict()
        write_update(path, before, after, meta)
        if not self.options.methods:  # recording only: `gradleak fedavg-invert` later
            return
        row = {"round": server_round, "node_id": int(node), "update": str(path)}
        gap = self._cannot_audit(settings, examples, before, after)
        if gap is not None:  # said now, on the console, not after the last round
            self._failures.append({**row, "error": gap})
            say(f"round {server_round}, node {node}: not audited: {gap}")
            return
        truth = self.truth(int(node), reply) if self.truth is not None else None
        for method in self.options.methods:  # one job per method: a free worker takes the next
            if method == TRAINING_FREE and examples != 1:
                gap = (f"method {TRAINING_FREE!r} inverts one image's single-step update; this "
                       f"client trained on {examples} examples")
                self._failures.append({**row, "method": method, "error": gap})
                say(f"round {server_round}, node {node}: {method} not run: {gap}")
                continue
            options = dataclasses.replace(self.options, methods=(method,))
            job = (path, self.model_fn, options, path.parent, truth, self.reference,
                   self.input_transform, None, None, f"{path.stem}-{method}",
                   self.reference_labels)
            info = {**row, "method": method}
            if self.workers == 0:
                say(f"round {server_round}, node {node}: {method} ...")
                self._jobs.append((info, audit_update(*job)))
                say(f"round {server_round}, node {node}: {method} done")
                continue
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"))
            future = self._pool.submit(audit_update, *job)
            future.add_done_callback(lambda done, where=f"round {server_round}, node {node}: "
                                     f"{method}": say(where + (" done" if not done.exception()
                                                               else " failed")))
            self._jobs.append((info, future))
        say(f"round {server_round}, node {node}: update recorded, "
            f"{len(self.options.methods)} audit(s) queued")

    def _cannot_audit(self, settings: dict[str, Any], examples: int,
                      before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
                      ) -> str | None:
        """Why an update cannot be audited from what was declared (checked before any work)."""
        if self.options.labels == "known":
            return None
        training = Training.from_mapping({**settings, **self.hyperparameters},
                                         "the round's config and hyperparameters")
        steps = counted_steps(self.model_fn(), before, after) \
            if (self.options.batchnorm or self.batchnorm) == "train" else None
        gap = inference_gap(training, steps or training.local_steps(examples), examples)
        return None if gap is None else (
            f"labels were not given, and {gap}: the round's config holds "
            f"{sorted(settings) or 'nothing'}; declare the rest with AuditStrategy("
            "hyperparameters={'local-epochs': ..., 'batch-size': ...}) (what the clients read "
            "from Flower's run config), or labels='known' with truth=")

    def finish(self) -> Path:
        """Wait for the audits still running; write audit.json and report.html."""
        from gradleak.report.fedavg import write_fedavg_report

        rows: list[dict[str, Any]] = []
        failures = list(self._failures)
        try:
            for info, job in self._jobs:
                try:
                    found = job.result() if isinstance(job, Future) else job
                except ConfigError as error:  # a bad update is named, the others still count
                    failures.append({**info, "error": str(error)})
                    say(f"round {info['round']}, node {info['node_id']}: {info['method']} "
                        f"failed: {error}")
                    continue
                rows += [{**r, "update": str(Path(info["update"]).relative_to(self.out))}
                         for r in found]
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        status = "failed" if failures and not rows else "partial" if failures else "complete"
        audit = {"format": AUDIT_FORMAT, "status": status, "finished": time.time(),
                 "model": self.model_ref, "shape": list(self.shape),
                 "options": self.options.to_dict(), "every": self.every,
                 "summary": summarise(rows), "rows": rows, "failures": failures}
        write_json(self.out / "audit.json", audit)
        report = write_fedavg_report(self.out, audit)
        say(f"{len({r['update'] for r in rows})} update(s) audited, {len(failures)} audit(s) "
            f"failed ({status}) -> {report}")
        return report


def say(line: str) -> None:
    """Progress and failures on the console, as they happen (stderr, beside Flower's log)."""
    print(f"gradleak audit: {line}", file=sys.stderr, flush=True)


def single(records: Any, where: str, kind: str) -> Any:
    if len(records) != 1:
        raise ConfigError(f"{where}: expected one {kind}, found {len(records)} "
                          f"({', '.join(records) or 'none'})")
    return next(iter(records.values()))


def jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()
            if isinstance(v, (bool, int, float, str, list, tuple))}


class InProcessGrid(Grid):
    """Flower's Grid with each node's ClientApp run here, one message at a time: a federated
    run with no Ray, no network and no SuperLink (tests, benchmarks, notebooks). Each node keeps
    its Context (state, node_config) across rounds, as a SuperNode does."""

    def __init__(self, client_app: Any, node_configs: list[dict[str, Any]],
                 run_config: dict[str, Any] | None = None, run_id: int = 1) -> None:
        from flwr.supercore.run import Run

        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self._contexts = {1000 + i: Context(run_id=run_id, node_id=1000 + i,
                                            node_config=dict(config), state=RecordDict(),
                                            run_config=dict(run_config or {}))
                          for i, config in enumerate(node_configs)}
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        import uuid

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            message.metadata.__dict__["_run_id"] = self._run.run_id
            context = self._contexts[message.metadata.dst_node_id]
            self._replies[message.metadata.message_id] = self.client_app(message, context)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))


def run_in_process(server_app: Any, client_app: Any, node_configs: list[dict[str, Any]],
                   run_config: dict[str, Any] | None = None) -> None:
    """Run a ServerApp against ClientApps in this process (see InProcessGrid)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    grid = InProcessGrid(client_app, node_configs, run_config)
    context = Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={},
                      state=RecordDict(), run_config=dict(run_config or {}))
    # what Flower's runtime sets before a ServerApp runs: messages read it when built
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id = 1, grid.run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    try:
        server_app(grid, context)
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
