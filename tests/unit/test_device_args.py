"""Device flags: --device, --gpu-memory-utilization, --cuda-graph-sizes, --enforce-eager."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm.config import DeviceConfig
from pagedllm.engine.arg_utils import EngineArgs, default_cuda_graph_sizes, parse_sizes, resolve_device


def test_cuda_graph_sizes_parse_from_cli_and_python() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--cuda-graph-sizes", "8,1,2,8", "--enforce-eager"]))
    assert args.cuda_graph_sizes == [1, 2, 8] and args.enforce_eager is True
    assert EngineArgs(cuda_graph_sizes="4, 2").cuda_graph_sizes == [2, 4]
    assert EngineArgs(cuda_graph_sizes=[16, 4]).cuda_graph_sizes == [4, 16]
    for bad in ("0,4", "a,b"):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineArgs(cuda_graph_sizes=bad)
    assert parse_sizes("3") == [3]


def test_default_graph_sizes_follow_max_num_seqs() -> None:
    assert default_cuda_graph_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_cuda_graph_sizes(256)[-1] == 256
    assert default_cuda_graph_sizes(10) == [1, 2, 4, 8]
    assert default_cuda_graph_sizes(1000)[-1] == 512


def test_device_resolution_and_validation() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == "cpu"
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        DeviceConfig(device="cuda", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        DeviceConfig(cuda_graph_sizes=(0,))
    assert not DeviceConfig(device="cuda", cuda_graph_sizes=(1, 2), enforce_eager=True).use_cuda_graphs
    assert not DeviceConfig(device="cpu", cuda_graph_sizes=(1, 2)).use_cuda_graphs
    assert DeviceConfig(device="cuda", cuda_graph_sizes=(1, 2)).use_cuda_graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_auto_on_a_cpu_keeps_the_cpu_and_its_dtype(tiny_model_dir: str) -> None:
    from pagedllm.hardware import choose_auto_dtype, cpu_flags

    config = EngineArgs(model=tiny_model_dir, max_num_seqs=16).create_engine_config()
    assert config.device_config.device == "cpu"
    assert config.model_config.dtype == choose_auto_dtype(cpu_flags())[0]
    assert config.device_config.cuda_graph_sizes == (1, 2, 4, 8, 16)
    assert not config.device_config.use_cuda_graphs
