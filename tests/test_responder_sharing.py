"""The responder model on the team's own weights (harness/responder.py) and in the memory plan (scale/memory.py): a
responder of an agent's model shares that agent's tensors until the agent first trains, then keeps the weights as
they were; with --lora it is the agents' base for the whole run; either way its replies never change. The plan
counts its weights once (none while it is a shared base) and its generate's KV cache."""
import pytest
import torch
from test_responder import ORACLE, ROWS, oracle_team
from test_responder import SAMPLING as ORACLE_SAMPLING

import harness.cli
from harness import episodes as episodes_module
from harness.config import parse_agents
from harness.loading import load_agent, save_agent
from harness.responder import shared_responder, shares_weights
from harness.run import build_team, run_inputs
from rollout import SamplingConfig, rollout
from scale import memory, run_memory
from scale.rollout_hf import HF
from scale.vllm_lora import lora_engines, make_team_backend

CHATS = [[{"role": "system", "content": "You are a suspect."}, {"role": "user", "content": f"Where were you {i}?"}]
         for i in range(3)]
SAMPLING = SamplingConfig(temperature=0.7, max_new_tokens=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A pretrained-like model as a local folder (a tiny model saved once): a spec that names weights, as a hub
    id, a folder or a GGUF file does (a tiny spec is built from a seed and is never shared)."""
    path = tmp_path_factory.mktemp("model") / "m"
    save_agent(load_agent("tiny", seed=3), path)
    return str(path)


def team_of(folder: str, *extra: str):
    cfg = harness.cli.parse_args(["--agents", f"{folder} x2", "--task", "env:detective-cases", "--env-model", folder,
                                  "--device", "cpu", *extra]).apply_preset()
    return build_team(run_inputs(cfg), "")


def replies(responder) -> list[list[int]]:
    contexts = [responder.encode_prompt(chat) for chat in CHATS]
    return HF.generate(responder, contexts, SAMPLING, seeds=[5, 6, 7])


def pointers(model) -> list[int]:
    return [p.data_ptr() for p in model.parameters()]


def train_one_step(agent) -> None:
    """One AdamW step of the agent on a made-up loss: its weights move."""
    opt = agent.start_training(1e-2)
    ids = torch.tensor([agent.encode_prompt(CHATS[0])])  # [1, seq]
    agent.model(ids).logits.float().pow(2).mean().backward()
    opt.step()
    agent.freeze()


def test_a_responder_of_an_agents_model_is_that_agent_until_it_trains(folder):
    team = team_of(folder)
    responder = team.config.responder
    first = team.agents[0]
    assert pointers(responder.model) == pointers(first.model)  # one set of weight tensors while shared
    assert not shares_weights(team)  # counted by the plan: it takes a copy once the agent trains
    before = [p.detach().clone() for p in first.model.parameters()]
    said = replies(responder)
    train_one_step(first)
    assert any(not torch.equal(a, b) for a, b in zip(before, first.model.parameters()))  # the agent moved
    assert set(pointers(responder.model)).isdisjoint(pointers(first.model))  # the responder took its own copy
    assert all(torch.equal(a, b) for a, b in zip(before, responder.model.parameters()))  # of the weights before
    assert replies(responder) == said  # bit-identical replies
    assert not any(p.requires_grad for p in responder.model.parameters())
    train_one_step(first)  # a later update leaves it alone too
    assert replies(responder) == said


def test_with_lora_the_responder_is_the_agents_base_for_the_whole_run(folder):
    team = team_of(folder, "--lora", "4")
    responder = team.config.responder
    base = team.agents[0].base
    assert base is team.agents[1].base and pointers(responder.model) == pointers(base.model)
    assert not any("lora_" in n for n, _ in responder.model.named_parameters())  # the base, no adapter in it
    assert shares_weights(team) and run_memory.responder_plan(team_cfg(folder, "--lora", "4"), team)[0] == 0
    said = replies(responder)
    train_one_step(team.agents[0])
    assert pointers(responder.model) == pointers(base.model) and replies(responder) == said


def test_with_lora_on_vllm_the_responder_of_the_base_needs_no_engine_of_its_own(folder):
    """--lora --backend vllm: a responder of the agents' base is served by the base's engine (one engine in all, its
    requests with no adapter); one of another model gets an engine of its own. No engine starts here."""
    cfg = team_cfg(folder, "--lora", "4", "--backend", "vllm")
    cfg.validate()  # the option check lets the responder through
    team = build_team(run_inputs(cfg), "")
    backend = make_team_backend("vllm", team, seed=0)
    responder, base = team.config.responder, team.agents[0].base
    assert lora_engines(team) == backend.n_engines == 1
    assert backend.base_for(responder) is base and backend.base_for(team.agents[1]) is base
    assert backend.request_kwargs(responder) == {}
    assert run_memory.responder_plan(cfg, team) == (0, 0)  # no weights, its KV in the base's engine's
    backend.close()
    other = build_team(run_inputs(team_cfg(folder, "--lora", "4", "--env-model", "tiny")), "")
    backend = make_team_backend("vllm", other, seed=0)
    assert lora_engines(other) == backend.n_engines == 2 and backend.base_for(other.config.responder) is None
    backend.close()


def test_on_cpu_the_plan_counts_one_vllm_engine_per_base_under_lora():
    dims = memory.QWEN3_DIMS["qwen3-0.6b"]

    def kv_cache(*extra):
        cfg = harness.cli.parse_args(["--agents", "Qwen3-0.6B x3", "--backend", "vllm", "--device", "cpu",
                                      *extra]).apply_preset()
        return run_memory.cpu_plan(cfg, dims, 3)[0]["kv_cache"]

    assert kv_cache("--lora", "8") * 3 == kv_cache()  # three agents on one base: one engine, not three


def team_cfg(folder: str, *extra: str):
    return harness.cli.parse_args(["--agents", f"{folder} x2", "--task", "env:detective-cases", "--env-model",
                                   folder, "--device", "cpu", *extra]).apply_preset()


def test_not_shared_where_the_agents_moved_or_the_spec_is_tiny(folder):
    team = team_of(folder)
    spec = team.agents[0].spec
    assert shared_responder(team, spec, at_start=False, one_process=True) is None  # a resumed run's agents moved
    assert shared_responder(team, spec, at_start=True, one_process=False) is None  # torchrun writes in place
    tiny = team_of_tiny()
    assert tiny.config.responder is not None and set(pointers(tiny.config.responder.model)).isdisjoint(
        p for a in tiny.agents for p in pointers(a.model))


def team_of_tiny():
    cfg = harness.cli.parse_args(["--agents", "tiny x2", "--task", "env:detective-cases", "--env-model", "tiny",
                                  "--device", "cpu"]).apply_preset()
    return build_team(run_inputs(cfg), "")


def test_the_plan_counts_the_responder_once_in_both_peaks():
    dims = memory.QWEN3_DIMS["qwen3-4b"]
    cfg = harness.cli.parse_args(["--agents", "Qwen3-4B x3", "--task", "env:detective-cases", "--max-rounds", "10",
                                  "--device", "cpu"]).apply_preset()
    plain = run_memory.run_estimate(cfg, dims, 3)
    weights, kv = 123 << 20, 45 << 20
    est = run_memory.run_estimate(cfg, dims, 3, (weights, kv))
    assert est["responder_weights"] == weights and est["responder_kv"] == kv
    assert est["peak_training"] - plain["peak_training"] == weights  # resident through training
    assert est["peak_rollout"] - plain["peak_rollout"] == weights + kv
    assert run_memory.responder_max_len(cfg, 3) == 1024 + 10 * 3 * (cfg.max_new_tokens + cfg.env_model_max_tokens)
    huge = {**est, "responder_weights": 10 * est["peak_rollout"]}
    huge["peak_rollout"] = sum(huge[p] for p in memory.PEAKS["peak_rollout"])
    huge["peak_training"] = sum(huge[p] for p in memory.PEAKS["peak_training"])
    with pytest.raises(ValueError, match="largest part: responder_weights .* fix: use a smaller --env-model"):
        memory.check_fits(huge, est["peak_rollout"] * 2)


def test_the_plan_of_a_loaded_responder_is_its_weights_and_its_kv(folder):
    team, cfg = team_of(folder), team_cfg(folder)
    config = team.config.responder.model.config
    weights, kv = run_memory.responder_plan(cfg, team)
    assert weights == memory.count_parameters(config) * 4  # float32 on CPU, counted although shared at the start
    tokens = max(cfg.token_budget, run_memory.responder_max_len(cfg, 2))
    assert kv == tokens * memory.kv_bytes_per_token(config, 4)


class Clock:
    """A clock that moves only when a backend says it spent time: the rounds' split is then exact."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SlowBackend:
    """The HF backend; each generate of the model ``slow`` advances ``clock`` by ``pause`` seconds."""

    def __init__(self, slow, pause: float, clock: Clock):
        self.slow, self.pause, self.clock = slow, pause, clock

    def generate(self, agent, contexts, sampling, seeds):
        if agent is self.slow:
            self.clock.now += self.pause
        return HF.generate(agent, contexts, sampling, seeds)

    def __getattr__(self, name):
        return getattr(HF, name)


def test_each_rounds_wall_time_is_split_between_the_agents_the_responder_and_the_steps(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(episodes_module, "time", clock)
    responder = load_agent("tiny", seed=7)
    team = oracle_team(responder)
    batch = rollout(team, ROWS, 1, ORACLE_SAMPLING, SlowBackend(responder, 3.0, clock), score=False, seed=3)
    assert [(r["agents_seconds"], r["responder_seconds"], r["step_seconds"]) for r in batch.per_round] == \
        [(0.0, 3.0, 0.0)] * ORACLE.max_rounds  # one responder generate a round
    batch = rollout(team, ROWS, 1, ORACLE_SAMPLING, SlowBackend(team.agents[1], 2.0, clock), score=False, seed=3)
    assert [(r["agents_seconds"], r["responder_seconds"]) for r in batch.per_round] == [(2.0, 0.0)] * ORACLE.max_rounds


def test_before_loading_a_responder_of_the_agents_base_under_lora_costs_no_weights():
    def plan(*extra):
        cfg = harness.cli.parse_args(["--agents", "Qwen3-4B x3", "--task", "env:detective-cases", "--device", "cpu",
                                      *extra]).apply_preset()
        specs = parse_agents(cfg.agents)
        return run_memory.spec_responder_bytes(cfg, parse_agents("Qwen3-4B")[0], specs), cfg

    (weights, kv), cfg = plan()
    dims = memory.QWEN3_DIMS["qwen3-4b"]
    assert weights == memory.count_parameters(dims) * 4 and kv > 0  # float32 on CPU
    (weights, kv_lora), _ = plan("--lora", "8")
    assert weights == 0 and kv_lora == kv
    assert plan("--backend", "vllm")[0] == (memory.count_parameters(dims) * 4, kv)  # an engine of its own
    assert plan("--lora", "8", "--backend", "vllm")[0] == (0, 0)  # answered by the base's engine, from its KV cache
    assert run_memory.spec_responder_bytes(cfg, parse_agents("tiny")[0], parse_agents(cfg.agents)) == (0, 0)
