"""The GPU memory budget's cap on the process's allocator: set for as long as its owner (a
Trainer, a bench row) lives, lifted however that ends. On a CPU machine CUDA's two calls are
stood in for (they cannot run without a GPU); tests/engine/test_engine_gpu.py runs the real cap."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from appliance.actors import trainer as trainer_module
from appliance.actors.trainer import Trainer, TrainerSettings
from appliance.actors.weight_store import WeightStore
from appliance.config import build_config
from appliance.engine.memory import gpu_memory_cap
from tests.helpers_model import make_model

GiB = 2**30


@pytest.fixture
def cuda_calls(monkeypatch):
    """What the cap asks of CUDA, recorded: (fraction, device) per call, on an 8 GiB card."""
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d))
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=8 * GiB)
    )
    return calls


def test_the_cap_holds_inside_the_block_and_is_lifted_after(cuda_calls) -> None:
    gpu = torch.device("cuda", 0)
    with gpu_memory_cap(gpu, 2 * GiB):
        assert cuda_calls == [(0.25, gpu)]
    assert cuda_calls == [(0.25, gpu), (1.0, gpu)]


def test_the_cap_is_lifted_when_the_block_fails(cuda_calls) -> None:
    gpu = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="out of memory"):
        with gpu_memory_cap(gpu, 2 * GiB):
            raise RuntimeError("out of memory")
    assert cuda_calls == [(0.25, gpu), (1.0, gpu)]


def test_a_budget_over_the_card_caps_at_the_whole_card(cuda_calls) -> None:
    gpu = torch.device("cuda", 0)
    with gpu_memory_cap(gpu, 80 * GiB):
        pass
    assert cuda_calls == [(1.0, gpu), (1.0, gpu)]


def test_no_budget_or_no_gpu_sets_no_cap(cuda_calls) -> None:
    with gpu_memory_cap(torch.device("cuda", 0), None), gpu_memory_cap(torch.device("cpu"), GiB):
        pass
    assert cuda_calls == []


@pytest.fixture(scope="module")
def handles(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("m") / "model", with_tokenizer=False)
    return WeightStore(str(model), "float32").handles()


@pytest.fixture
def caps(monkeypatch):
    """The trainer's cap, recorded: ("set", budget) when entered, ("lifted", budget) on exit."""
    seen: list[tuple[str, int | None]] = []

    @contextlib.contextmanager
    def recording(device, budget):
        seen.append(("set", budget))
        try:
            yield
        finally:
            seen.append(("lifted", budget))

    monkeypatch.setattr(trainer_module, "gpu_memory_cap", recording)
    return seen


def test_a_trainer_holds_its_budget_until_it_closes(handles, caps) -> None:
    settings = TrainerSettings(lora=build_config({}, {}).lora_spec(), gpu_memory_budget=3 * GiB)
    trainer = Trainer(handles, settings)
    assert caps == [("set", 3 * GiB)]
    trainer.close()
    assert caps == [("set", 3 * GiB), ("lifted", 3 * GiB)]


def test_a_trainer_whose_engine_fails_to_build_lifts_its_cap(handles, caps, monkeypatch) -> None:
    def fail(self, group):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(Trainer, "_make_engine", fail)
    settings = TrainerSettings(lora=build_config({}, {}).lora_spec(), gpu_memory_budget=GiB)
    with pytest.raises(torch.OutOfMemoryError):
        Trainer(handles, settings)
    assert caps == [("set", GiB), ("lifted", GiB)]
