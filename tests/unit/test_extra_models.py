"""--extra-models: its two forms, the checks of names and counts, the KV budget split between the
models that may be loaded at once, and the merged /metrics of several models (one HELP and TYPE
per name, every model's samples, as prometheus_client's own parser reads them)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.model_pool import (
    ExtraModel,
    check_extra_models,
    parse_extra_model,
    split_kv_budget,
)
from pagedllm.metrics import MergedRegistry, PrometheusStatLogger


def test_both_forms() -> None:
    assert parse_extra_model(" tiny = /models/tiny ") == ExtraModel("tiny", "/models/tiny")
    e = parse_extra_model('{"name": "q", "model": "smollm2-135m-instruct", "max_model_len": 512, '
                          '"kv_cache_memory": "64MiB"}')
    assert (e.name, e.model, e.overrides) == ("q", "smollm2-135m-instruct", {"max_model_len": 512,
                                                                            "kv_cache_memory": "64MiB"})


@pytest.mark.parametrize(("text", "reason"), [
    ("tiny", "as NAME=PATH_OR_BUILTIN"),
    ("=path", "must not be empty"),
    ("name=", "must not be empty"),
    ("{bad", "cannot read '{bad' as JSON"),
    ('{"name": "q"}', '{"name": ..., "model": ..., <engine flags>}'),
    ('{"name": "q", "model": "m", "served_model_name": "x"}', "unknown engine flags ['served_model_name']"),
    ('{"name": "q", "model": "m", "dtype": "float99"}', "float99"),
    ('{"name": "q", "model": "m", "kv_cache_memory": "12XB"}', "as a size in bytes"),
])
def test_bad_values_name_the_value_and_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        parse_extra_model(text)
    assert reason in str(e.value) and (text.strip() in str(e.value) or text.startswith("{bad")), str(e.value)


def test_names_and_counts_are_checked() -> None:
    a, b = ExtraModel("a", "x"), ExtraModel("b", "y")
    check_extra_models("main", [a, b], 30, 2)
    with pytest.raises(ValueError, match="'a' is served twice"):
        check_extra_models("main", [a, a], None, None)
    with pytest.raises(ValueError, match="the main model's"):
        check_extra_models("a", [a], None, None)
    with pytest.raises(ValueError, match="at least 2"):
        check_extra_models("main", [a], None, 1)
    with pytest.raises(ValueError, match="non-negative"):
        check_extra_models("main", [a], -1, None)
    with pytest.raises(ValueError, match="need --extra-models"):
        check_extra_models("main", [], 10, None)


def test_the_kv_budget_is_split_between_the_models_loaded_at_once() -> None:
    main = EngineArgs(model="m", kv_cache_memory="300MiB", max_model_len=512, tokenizer="tok")
    extras = [ExtraModel("a", "pa"), ExtraModel("b", "pb", {"kv_cache_memory": "10MiB", "max_model_len": 128})]
    m, (a, b), line = split_kv_budget(main, extras, max_loaded=None)
    assert m.kv_cache_memory == a.kv_cache_memory == 100 << 20 and b.kv_cache_memory == 10 << 20
    assert (a.model, a.served_model_name, a.max_model_len, a.tokenizer) == ("pa", "a", 512, None)
    assert (b.model, b.served_model_name, b.max_model_len) == ("pb", "b", 128)
    assert "300 MiB for at most 3 loaded models, 100 MiB each" in line
    m, (a, _), _ = split_kv_budget(main, extras, max_loaded=2)
    assert m.kv_cache_memory == a.kv_cache_memory == 150 << 20
    # No --kv-cache-memory: the CPU default (30 % of the available memory, at most 4 GiB) is split.
    m, (a, _), _ = split_kv_budget(EngineArgs(model="m"), extras, max_loaded=2, available_bytes=10 << 30)
    assert m.kv_cache_memory == a.kv_cache_memory == int((10 << 30) * 0.3) // 2


def test_merged_metrics_have_one_family_per_name() -> None:
    loggers = [PrometheusStatLogger(name, 256, 16, 100, True) for name in ("main", "qwen")]
    loggers[1].count_request("completions")
    text = generate_latest(MergedRegistry([lg.registry for lg in loggers])).decode()
    assert text.count("# TYPE pagedllm:api_requests_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["pagedllm:num_requests_running"]
    assert sorted(s.labels["model_name"] for s in running.samples) == ["main", "qwen"]
    requests = [s for s in families["pagedllm:api_requests"].samples if s.name.endswith("_total")]
    assert [(s.labels["model_name"], s.value) for s in requests] == [("qwen", 1.0)]
