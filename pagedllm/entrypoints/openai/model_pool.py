"""Several base models behind one server (`--extra-models`): each in its own engine core, loaded
on its first request, unloaded after `--model-idle-unload-s` seconds without requests, and the
least recently used idle one unloaded first when `--max-loaded-models` are loaded already.

The main model (`--model`) is loaded at start and stays loaded. An extra model is an engine
(`AsyncLLMEngine` with its engine-core process) plus its own serving app (the same routes as the
main model's, built by `make_app`); `model_router.py` hands each request naming it to that app.
A load that fails (missing or corrupt weights) fails the requests that waited for it, with the
reason; the next request tries again. docs/multi-model.md."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.hardware import default_cpu_kv_bytes
from pagedllm.metrics import PREFIX, PrometheusStatLogger
from pagedllm.utils import json_or_pair

logger = logging.getLogger(__name__)

# Engine flags an extra model may not set in its JSON form (the name is the served name).
_NOT_OVERRIDABLE = frozenset({"model", "served_model_name"})


@dataclass(frozen=True)
class ExtraModel:
    """One --extra-models entry: the served name, the model (folder, .gguf or built-in name) and
    engine flags of its own (EngineArgs field names; the others are the server's)."""

    name: str
    model: str
    overrides: dict[str, Any] = field(default_factory=dict)


def parse_extra_model(text: str) -> ExtraModel:
    """'NAME=PATH_OR_BUILTIN' or '{"name": ..., "model": ..., "<engine flag>": ...}'; ValueError
    naming the value and what is wrong."""
    text = text.strip()
    d = json_or_pair(text)
    if isinstance(d, dict):
        if not isinstance(d.get("name"), str) or not isinstance(d.get("model"), str):
            raise ValueError(f"{text!r}: an extra model is {{\"name\": ..., \"model\": ..., <engine flags>}}")
        overrides = {k: v for k, v in d.items() if k not in ("name", "model")}
        known = {f.name for f in dataclasses.fields(EngineArgs)} - _NOT_OVERRIDABLE
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"{text!r}: unknown engine flags {unknown} (use EngineArgs names, e.g. max_model_len)")
        fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
        for key, value in overrides.items():
            f = fields[key]
            choices = f.metadata.get("choices")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            if choices is not None and value not in choices:
                raise ValueError(f"{text!r}: {key} must be one of {list(choices)}, got {value!r}")
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ValueError(f"{text!r}: {key} must be true or false, got {value!r}")
        try:
            EngineArgs(model=d["model"], **overrides)  # the values go through the flags' parsers
        except (TypeError, ValueError) as e:
            raise ValueError(f"{text!r}: {e}") from None
        name, model = d["name"].strip(), d["model"].strip()
    elif d is None:
        raise ValueError(f"cannot read {text!r} as NAME=PATH_OR_BUILTIN")
    else:
        (name, model), overrides = d, {}
    if not name or not model:
        raise ValueError(f"{text!r}: the name and the model must not be empty")
    return ExtraModel(name, model, overrides)


def check_extra_models(main_name: str, extras: list[ExtraModel], idle_unload_s: float | None,
                       max_loaded: int | None) -> None:
    """ValueError for a name served twice or a bad idle timeout / model count."""
    seen = {main_name}
    for e in extras:
        if e.name in seen:
            raise ValueError(f"--extra-models: the name {e.name!r} is served twice"
                             + (" (it is the main model's)" if e.name == main_name else ""))
        seen.add(e.name)
    if idle_unload_s is not None and idle_unload_s < 0:
        raise ValueError(f"--model-idle-unload-s must be non-negative, got {idle_unload_s}")
    if max_loaded is not None and max_loaded < 2:
        raise ValueError(f"--max-loaded-models must be at least 2 (the main model and one extra), got {max_loaded}")
    if not extras and (idle_unload_s or max_loaded is not None):
        raise ValueError("--model-idle-unload-s and --max-loaded-models need --extra-models")


def split_kv_budget(main: EngineArgs, extras: list[ExtraModel], max_loaded: int | None,
                    available_bytes: int | None = None) -> tuple[EngineArgs, list[EngineArgs], str]:
    """The engine args of the main model and of each extra one, with the KV budget split so that
    the most models loaded at once fit: each engine gets (--kv-cache-memory, or the CPU default)
    / N, N = --max-loaded-models (default: every model). An extra model that names its own
    kv_cache_memory or num_kv_blocks keeps it. Returns a line for the start-up log too."""
    n = max_loaded or (1 + len(extras))
    if main.num_kv_blocks is not None:
        per, line = None, f"KV cache: {main.num_kv_blocks} blocks per model (--num-kv-blocks)"
    else:
        total = main.kv_cache_memory
        if total is None:
            total = default_cpu_kv_bytes(available_bytes)
        per = total // n
        line = (f"KV cache: {total / (1 << 20):.0f} MiB for at most {n} loaded models, "
                f"{per / (1 << 20):.0f} MiB each")
    main_args = dataclasses.replace(main, kv_cache_memory=per) if per is not None else main
    extra_args = []
    for e in extras:
        base = dataclasses.replace(main_args, model=e.model, served_model_name=e.name, tokenizer=None)
        extra_args.append(dataclasses.replace(base, **e.overrides))
    return main_args, extra_args, line


@dataclass
class _Entry:
    name: str
    args: EngineArgs
    engine: Any = None
    app: Any = None
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    stat_logger: PrometheusStatLogger | None = None
    max_model_len: int | None = None
    root: str | None = None
    failures: int = 0
    last_error: OpenAIError | None = None


class ModelPool:
    """The extra models by name and their engines' lifecycle (every method runs on the event loop)."""

    def __init__(self, main_name: str, extras: list[tuple[str, EngineArgs]],
                 make_app: Callable[[Any, str, PrometheusStatLogger], Any],
                 idle_unload_s: float | None = None, max_loaded: int | None = None,
                 engine_kwargs: dict[str, Any] | None = None,
                 load_engine: Callable[..., Any] | None = None) -> None:
        self.main_name = main_name
        self.entries = {name: _Entry(name, args, root=args.model) for name, args in extras}
        self.make_app = make_app
        self.idle_unload_s = idle_unload_s or None
        self.max_loaded = max_loaded or (1 + len(self.entries))
        self.engine_kwargs = dict(engine_kwargs or {})
        self._load_engine = load_engine
        self._lock = asyncio.Lock()
        self._released = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.loaded_gauge = Gauge(PREFIX + "model_loaded", "1 while the model's engine is loaded.", ["model_name"],
                                  registry=self.registry)
        self.loads = Counter(PREFIX + "model_loads", "Loads of the model's engine, by outcome.",
                             ["model_name", "outcome"], registry=self.registry)
        self.loaded_gauge.labels(main_name).set(1)
        for name in self.entries:
            self.loaded_gauge.labels(name).set(0)

    # ---- what the routes ask ---------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.entries)

    def loaded_names(self) -> list[str]:
        return [n for n, e in self.entries.items() if e.app is not None]

    def cards(self, card_cls: Any) -> list[Any]:
        return [card_cls(id=e.name, root=e.root, max_model_len=e.max_model_len) for e in self.entries.values()]

    def registries(self) -> list[Any]:
        return [self.registry, *(e.stat_logger.registry for e in self.entries.values() if e.stat_logger)]

    def log_start(self) -> None:
        logger.info("Models: %s (loaded)%s", self.main_name, "".join(
            f", {n} (registered: {e.args.model}, loads on its first request)" for n, e in self.entries.items()))
        logger.info("At most %d models loaded at once; idle models are %s", self.max_loaded,
                    f"unloaded after {self.idle_unload_s:g} s" if self.idle_unload_s else "kept loaded")

    # ---- serving one request ---------------------------------------------------------------
    async def serve(self, name: str, scope: Any, receive: Any, send: Any) -> None:
        """Runs one request on model `name`'s app, loading the model first if it is not loaded;
        OpenAIError (500) naming the model and the reason if it cannot be loaded."""
        entry = self.entries[name]
        entry.in_flight += 1
        try:
            app = await self._acquire(entry)
            await app(scope, receive, send)
        finally:
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            if entry.in_flight == 0:
                self._released.set()

    async def _acquire(self, entry: _Entry) -> Any:
        failures = entry.failures
        while entry.app is None:
            async with self._lock:
                if entry.app is not None:
                    break
                if entry.failures != failures and entry.last_error is not None:
                    raise entry.last_error  # the load this request waited for failed; the next request tries again
                await self._make_room(entry)
                await self._load(entry)
        entry.last_used = time.monotonic()
        return entry.app

    async def _make_room(self, wanted: _Entry) -> None:
        """Unloads the least recently used idle models until `wanted` fits; waits while every
        loaded model has requests in flight."""
        while 1 + len(self.loaded_names()) >= self.max_loaded:
            idle = [e for e in self.entries.values() if e.app is not None and e.in_flight == 0 and e is not wanted]
            if idle:
                victim = min(idle, key=lambda e: e.last_used)
                await self._unload(victim, f"to make room for {wanted.name} (--max-loaded-models {self.max_loaded})")
                continue
            self._released.clear()
            await self._released.wait()

    async def _load(self, entry: _Entry) -> None:
        logger.info("Loading model %s (%s)", entry.name, entry.args.model)
        start = time.monotonic()
        loggers = [entry.stat_logger] if entry.stat_logger is not None else []
        try:
            engine = await asyncio.to_thread(self._engine_factory(), entry.args, stat_loggers=loggers,
                                             **self.engine_kwargs)
        except Exception as e:
            self.loads.labels(entry.name, "failed").inc()
            reason = str(e) or type(e).__name__
            logger.error("Model %s could not be loaded: %s", entry.name, reason)
            entry.failures += 1
            entry.last_error = OpenAIError(500, f"the model `{entry.name}` could not be loaded: {reason}",
                                           type="server_error", param="model", code="model_load_failed")
            raise entry.last_error from None
        mc, cc = engine.model_config, engine.config.cache_config
        if entry.stat_logger is None:
            entry.stat_logger = PrometheusStatLogger(entry.name, mc.max_model_len, cc.block_size, engine.num_blocks,
                                                     cc.enable_prefix_caching)
            engine.stat_loggers.append(entry.stat_logger)
        entry.max_model_len, entry.root = mc.max_model_len, mc.path
        engine.on_dead.append(lambda: self._on_dead(entry, engine))
        engine.start()
        entry.app = self.make_app(engine, entry.name, entry.stat_logger)
        entry.engine = engine
        self.loads.labels(entry.name, "loaded").inc()
        self.loaded_gauge.labels(entry.name).set(1)
        logger.info("Loaded model %s in %.1f s (%d KV blocks); loaded now: %s", entry.name, time.monotonic() - start,
                    engine.num_blocks, ", ".join([self.main_name, *self.loaded_names()]))

    def _engine_factory(self) -> Callable[..., Any]:
        if self._load_engine is not None:
            return self._load_engine
        from pagedllm.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine.from_engine_args

    async def _unload(self, entry: _Entry, why: str) -> None:
        engine, entry.engine, entry.app = entry.engine, None, None  # new requests wait for a load from now on
        if engine is not None:
            await engine.aclose()
        self.loaded_gauge.labels(entry.name).set(0)  # once its process has ended
        if entry.stat_logger is not None:
            entry.stat_logger.reset_gauges()
        logger.info("Unloaded model %s %s", entry.name, why)

    def _on_dead(self, entry: _Entry, engine: Any) -> None:
        # The model's engine failed: its requests in flight have their error; the next request loads it again.
        if entry.engine is engine:
            logger.error("Model %s's engine failed; it will be loaded again on its next request", entry.name)
            entry.engine, entry.app = None, None
            self.loaded_gauge.labels(entry.name).set(0)
            asyncio.get_running_loop().create_task(engine.aclose())

    # ---- idle unloading --------------------------------------------------------------------
    def start(self) -> None:
        if self.idle_unload_s and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._unload_idle())

    async def _unload_idle(self) -> None:
        assert self.idle_unload_s
        period = min(max(self.idle_unload_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            if self._lock.locked():
                continue
            for e in list(self.entries.values()):
                if self._idle(e):
                    async with self._lock:
                        if self._idle(e):  # still: a request may have come while the lock was taken
                            await self._unload(e, f"after {time.monotonic() - e.last_used:.1f} s idle "
                                                  "(--model-idle-unload-s)")

    def _idle(self, e: _Entry) -> bool:
        return (e.app is not None and e.in_flight == 0
                and time.monotonic() - e.last_used >= self.idle_unload_s)  # type: ignore[operator]

    def begin_shutdown(self) -> None:
        """Tells the loaded models' requests in flight to end (503), as the main model's are told."""
        for e in self.entries.values():
            if e.app is not None:
                e.app.state.server_state.shutting_down = True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for e in self.entries.values():
            if e.engine is not None:
                await self._unload(e, "(server shutting down)")

    def shutdown(self) -> None:
        """Stops every extra engine (after the event loop has ended; never leaves one running)."""
        for e in self.entries.values():
            engine, e.engine, e.app = e.engine, None, None
            if engine is not None:
                engine.shutdown()
