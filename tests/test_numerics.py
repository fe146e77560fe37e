"""Paper-scale numerics on CPU: bf16 agents with fp32 master weights, the sampler that is the tempered
softmax and nothing else, top-p refused for training, and the one log-prob path (a row's log-probs do
not depend on the rows sharing its call nor on requires_grad, so the ratio is exactly 1 before the
first step and log rho exactly 0 for an agent that did not move)."""
import copy
import random
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from test_sat import small_config

import advantage
import harness.cli
import logprobs
import sat
import update
from harness.config import Config
from harness.loading import load_agent
from harness.math_grading import math_team_config
from harness.processes import OneProcess
from harness.run import trust_regions_for
from harness.tasks import arithmetic_problems
from logprobs import TurnTensors, batched_response_logprobs, left_pad, measure_kl, right_pad, turn_forward
from rollout import SamplingConfig, Turn, rollout
from scale.rollout_hf import HF, _sampler, check_sampler, generate_hf, sampler_config
from team import Agent, Team
from trust_region import TrustRegion


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return 2.0 ** (exp - 7)


def synthetic_turn(agent: Agent, n: int = 32, seed: int = 0, max_ctx: int = 8, max_resp: int = 6,
                   budget: int = 1 << 14) -> Turn:
    """n random contexts and responses of the tiny vocabulary, behaviour log-probs from the agent itself."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(6, 100, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    ctx = [draw(3, max_ctx) for _ in range(n)]
    resp = [draw(1, max_resp) for _ in range(n)]
    c, cm = left_pad(ctx, agent.tokenizer.pad_token_id)
    r, rm = right_pad(resp, agent.tokenizer.pad_token_id)
    logp = batched_response_logprobs(agent.model, TurnTensors(c, cm, r, rm), 1.0, budget)
    return Turn(0, c, cm, r, rm, logp, [""] * n, [None] * n, torch.zeros(n, dtype=torch.bool))


def train_cfg(**kw):
    cfg = dict(lr=1e-5, epochs=16, minibatch_size=32, token_budget=1 << 14, ratio="seq-mean", eps_clip=0.2,
               kl_estimator="k3_new", adv="grpo", temperature=1.0, kl_check_every=0, gradient_checkpointing=False,
               keep_optimizer_state=False, delta=1.0, quantile=0.99)
    cfg.update(kw)
    sampling = SamplingConfig(temperature=cfg.pop("temperature"), token_budget=cfg.pop("token_budget"))
    return SimpleNamespace(**cfg, sampling=sampling)  # the fields of sat_config.SatConfig that update reads


def sixteen_steps(agent: Agent, cfg) -> dict:
    """16 AdamW steps at lr 1e-5 through update.train_agents (the run's own update)."""
    turn = synthetic_turn(agent)
    adv = torch.tensor([1.0, -1.0] * 16)  # [32] fixed advantages: a consistent gradient
    zeros = torch.zeros(32)
    inputs = advantage.UpdateInputs(turn, adv, adv, zeros, zeros)
    team = Team([agent], math_team_config())
    regions = {0: TrustRegion.fresh(cfg.delta, cfg.quantile, 0, 0.0, "fixed", cfg.lr)}
    return update.train_agents(team, [0], {0: inputs}, cfg, regions, {}, {0: copy.deepcopy(agent.model)})[0]


# -- 1. bf16 weights with an fp32 master copy --------------------------------------------
def test_bf16_agent_learns_at_lr_1e5_like_the_fp32_reference():
    """Fails on a bare-bf16 AdamW (about 15% of the weights move, by one
    rounding step); with fp32 master weights nearly all move, and the bf16
    result is the fp32 reference update up to bf16 resolution."""
    low = load_agent("tiny", dtype=torch.bfloat16, seed=3)
    ref = Agent(low.spec, copy.deepcopy(low.model).float(), low.tokenizer)  # same start, exactly, in fp32
    before = [p.detach().clone() for p in low.model.parameters()]
    start = [p.detach().clone() for p in ref.model.parameters()]
    stats = sixteen_steps(low, train_cfg())
    sixteen_steps(ref, train_cfg())
    assert stats.inner_steps == 16
    after = list(low.model.parameters())
    moved = sum(int((a != b).sum()) for a, b in zip(after, before)) / sum(p.numel() for p in before)
    assert moved >= 0.9, f"only {moved:.1%} of the bf16 weights moved"
    ref_after = list(ref.model.parameters())
    master = low.master_weights  # fp32, kept on the host between the agent's turns
    assert master is not None and all(m.dtype == torch.float32 for m in master)
    # the bf16 weights are the fp32 master rounded to nearest: the only loss is bf16 resolution
    assert all(torch.equal(a, m.to(torch.bfloat16)) for a, m in zip(after, master))
    # and they sit within one bf16 ulp of the fp32 reference run, up to the drift that bf16
    # gradients cause (Adam turns a small gradient's sign into a full lr step): 4 lr
    close = torch.cat([((a.float() - r).abs() <= bf16_ulp(r) + 4e-5).flatten() for a, r in zip(after, ref_after)])
    assert close.float().mean() >= 0.99
    # the unrounded step of the master is the reference step (the same update, not a rounded-away one)
    step_m = torch.cat([(m - s).flatten() for m, s in zip(master, start)])
    step_r = torch.cat([(r.detach() - s).flatten() for r, s in zip(ref_after, start)])
    assert torch.cosine_similarity(step_m, step_r, dim=0) > 0.99
    assert (step_m - step_r).abs().median() <= 0.5e-5
    assert step_r.abs().max() > 15e-5  # the reference did take 16 steps of about lr


def test_master_weights_persist_between_turns_and_restart_where_the_weights_changed():
    agent = load_agent("tiny", dtype=torch.bfloat16, seed=1)
    sixteen_steps(agent, train_cfg(epochs=2))
    master = [m.clone() for m in agent.master_weights]
    residual = sum(int((m != m.to(torch.bfloat16).float()).sum()) for m in master)
    assert residual > 0  # sub-ulp progress that bf16 alone would have lost
    with torch.no_grad():  # e.g. the line search kept half the step: this tensor's bf16 values changed
        first = next(agent.model.parameters())
        first.add_(bf16_ulp(first.float()).to(first.dtype) * 4)
    opt = agent.start_training(1e-5)
    assert torch.equal(opt.master[0], first.float())  # changed weights restart from their bf16 value
    assert all(torch.equal(m, s) for m, s in zip(opt.master[1:], master[1:]))  # the others keep their fp32 residual
    agent.freeze()
    assert agent.optimizer is None and all(p.grad is None for p in agent.model.parameters())


# -- 2. the sampler is the tempered softmax, whatever the checkpoint ships ------------------
class SyncedForwards(OneProcess):
    """One process sampling as a sharded model does: through HF ``generate`` (``scale.rollout_hf.generate_hf``)."""

    def synced_forwards(self, model) -> bool:
        return True


@pytest.mark.slow  # over 10 s on two busy cores
@pytest.mark.parametrize("through_generate", [False, True], ids=["decode", "generate"])
def test_sampler_ignores_the_checkpoints_generation_config(through_generate):
    """repetition_penalty 1.3, min_p 0.2 and no_repeat_ngram_size 2 in the
    checkpoint: first-token frequencies still match the teacher-forced
    tempered softmax (chi-square), and the start-up check passes; both on
    ``scale.rollout_hf.decode`` and on HF ``generate`` (the sharded path, which reads
    the generation config)."""
    torch.manual_seed(0)
    agent = load_agent("tiny", seed=5)
    if through_generate:
        agent.procs = SyncedForwards()
    with torch.no_grad():
        agent.model.model.norm.weight.mul_(4.0)  # top token 0.32 (a context token): min_p 0.2 would cut 46% of the mass
    gc = agent.model.generation_config
    gc.repetition_penalty, gc.min_p, gc.no_repeat_ngram_size = 1.3, 0.2, 2
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=1, token_budget=1 << 16)
    check_sampler(agent, sampling)  # would name the field if a processor still applied
    ctx = [10, 11, 12, 10, 13, 14, 15, 10]  # repeated tokens: repetition penalty and no-repeat-ngram would act
    with torch.no_grad():
        probs = torch.softmax(agent.model(torch.tensor([ctx])).logits[0, -1].double() / 0.7, -1)  # [V]
    n = 20000
    pad = agent.tokenizer.pad_token_id  # a sampled pad is stripped from the response: count it back
    first = torch.tensor([r[0] if r else pad for r in generate_hf(agent, [ctx] * n, sampling, list(range(n)))])
    counts = torch.bincount(first, minlength=len(probs)).double()  # [V]
    big = probs * n >= 5  # Pearson's chi-square on the cells with expected count >= 5, the rest pooled
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([probs[big] * n, (probs[~big] * n).sum()[None]])
    assert float(1 - probs[big].sum()) < 0.5 and int(big.sum()) >= 5  # the test has power: many cells
    p_value = chisquare(obs.numpy(), exp.numpy()).pvalue
    tv = 0.5 * float((counts / n - probs).abs().sum())
    assert p_value > 1e-4 and tv < 0.03, (p_value, tv)
    assert gc.repetition_penalty == 1.3  # the checkpoint's own config is left as it was


def test_check_sampler_names_the_offending_field(monkeypatch):
    import scale.rollout_hf as rollout_hf

    agent = load_agent("tiny")
    real = rollout_hf.sampler_config

    def leaky(a, s):
        cfg = real(a, s)
        cfg.repetition_penalty = 1.05
        return cfg

    monkeypatch.setattr(rollout_hf, "sampler_config", leaky)
    with pytest.raises(RuntimeError, match="repetition_penalty=1.05") as err:
        check_sampler(agent, SamplingConfig(temperature=1.0))
    assert "\n" not in str(err.value)


def test_sampler_config_gives_transformers_nothing_to_warn_about(monkeypatch):
    """transformers' strict validation (what it otherwise logs as "generation flags are not valid") passes on the
    sampler's config, alone and merged as generate merges it; sampling inside generate is still refused by name."""
    import scale.rollout_hf as rollout_hf

    agent = load_agent("tiny")
    cfg = sampler_config(agent, SamplingConfig(temperature=0.7))
    cfg.validate(strict=True)
    with _sampler(agent.model, cfg):
        agent.model._prepare_generation_config(cfg)[0].validate(strict=True)

    def sampling(a, s):
        cfg = sampler_config(a, s)
        cfg.do_sample = True
        return cfg

    monkeypatch.setattr(rollout_hf, "sampler_config", sampling)
    with pytest.raises(RuntimeError, match="do_sample=True"):
        check_sampler(agent, SamplingConfig(temperature=1.0))


# -- 3. top_p < 1 is for evaluation only ------------------------------------------------------
def test_top_p_below_one_refused_for_training_allowed_for_evaluation(tmp_path):
    team = Team([load_agent("tiny")], math_team_config())
    problems = arithmetic_problems(2, seed=0)
    nucleus = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=3)
    with pytest.raises(ValueError, match="--top-p 0.9 < 1 cannot be used for training") as err:
        rollout(team, problems, 2, nucleus, HF)  # keeps behaviour log-probs: refused
    assert "\n" not in str(err.value) and "--top-p 1" in str(err.value)
    assert len(rollout(team, problems, 2, nucleus, HF, score=False)) == 4  # evaluation: fine
    with pytest.raises(ValueError, match="cannot be used for training"):
        Config(top_p=0.9, device="cpu").apply_preset().validate()
    assert harness.cli.main(["--top-p", "0.9", "--out", str(tmp_path / "r")]) == 2


def test_dtype_option_defaults_and_errors():
    assert Config(device="cpu").apply_preset().dtype == "float32"
    assert harness.cli.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype 'float16' is not one of"):
        Config(device="cpu", dtype="float16").apply_preset().validate()
    with pytest.raises(SystemExit):
        harness.cli.parse_args(["--dtype", "float16"])


# -- 4. one log-prob path in bf16 ----------------------------------------------------------------
def test_bf16_ratio_is_one_before_any_update_and_log_rho_of_unmoved_agents_is_zero(tmp_path):
    torch.manual_seed(0)
    team = Team([load_agent("tiny", dtype=torch.bfloat16, seed=k) for k in range(2)], math_team_config())
    cfg = Config(agents="tiny x2", dtype="bfloat16", batch_size=48, group_size=4, epochs=1, minibatch_size=20,
                 token_budget=256, max_new_tokens=4, device="cpu", out=str(tmp_path)).apply_preset()
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    problems = arithmetic_problems(12, seed=1)
    # an agent that did not move: exact KL 0 and log rho 0 at every token, new log-probs = behaviour, bit for bit
    batch = rollout(team, problems, cfg.group_size, sampling, HF)
    for j, agent in enumerate(team.agents):
        kl, new_logp, log_rho = measure_kl(agent, copy.deepcopy(agent.model), batch.turns[j], cfg.temperature,
                                           cfg.token_budget)
        assert kl.numel() == batch.turns[j].num_tokens and torch.equal(kl, torch.zeros_like(kl))
        assert torch.equal(log_rho, torch.zeros_like(log_rho))
        assert torch.equal(new_logp, batch.turns[j].behaviour_logprobs)
    # a whole bf16 stage: every agent's first step (before any update, rows in shuffled
    # micro-batches of another size than the rollout's) sees max |log r| < 1e-3
    run = sat.RunState(team, trust_regions_for(cfg, 2), {}, random.Random(0), HF)
    record, _ = sat.sat_stage(run, problems, cfg.core(), sampling)
    for step in record.agents:
        assert step.train.step0_log_ratio_max < 1e-3
    assert all(a.dtype == torch.bfloat16 for a in team.agents)


def test_bf16_ratio_is_one_with_variable_lengths_and_other_chunkings():
    """Contexts of 3-19 and responses of 1-11 tokens; behaviour in chunks of 8 rows, training in
    shuffled micro-batches of 16: trimming each chunk's padding would give max |log r| = 4e-3 here;
    the turn's one layout gives < 1e-3 (0 on CPU)."""
    agent = load_agent("tiny", dtype=torch.bfloat16, seed=0)
    turn = synthetic_turn(agent, n=48, max_ctx=20, max_resp=12, budget=256)
    adv = torch.tensor([1.0, -1.0] * 24)
    zeros = torch.zeros(48)
    cfg = train_cfg(epochs=1, minibatch_size=16, lr=1e-3)
    regions = {0: TrustRegion.fresh(cfg.delta, cfg.quantile, 0, 0.0, "fixed", cfg.lr)}
    inputs = {0: advantage.UpdateInputs(turn, adv, adv, zeros, zeros)}
    stats = update.train_agents(Team([agent], math_team_config()), [0], inputs, cfg, regions, {},
                                {0: copy.deepcopy(agent.model)})[0]
    assert stats.inner_steps == 3 and stats.step0_log_ratio_max < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_checkpointing_changes_no_gradient(dtype, monkeypatch):
    """A chunk's logits are recomputed in the backward pass only above
    HEAD_CHECKPOINT_BYTES (a real vocabulary); kept or recomputed, the
    log-probs and every gradient are the same bit for bit."""
    agent = load_agent("tiny", seed=0, dtype=dtype)
    turn = synthetic_turn(agent, n=16, seed=5)
    tensors = turn.tensors
    recomputed, results = [], []
    real_checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **kw: recomputed.append(1) or real_checkpoint(*a, **kw))
    for limit in (logprobs.HEAD_CHECKPOINT_BYTES, 0):  # the tiny head's logits kept, then forced through the checkpoint
        monkeypatch.setattr(logprobs, "HEAD_CHECKPOINT_BYTES", limit)
        model = copy.deepcopy(agent.model).requires_grad_(True)
        logp, _ = logprobs.turn_forward(model, tensors, slice(None), 0.8)  # [16, Lr]
        (-(logp * torch.linspace(-1, 2, logp.numel()).view_as(logp)).sum()).backward()
        results.append((logp.detach(), [p.grad for p in model.parameters()]))
        assert len(recomputed) == (0 if limit else 1)
    (lp_kept, g_kept), (lp_ckpt, g_ckpt) = results
    assert torch.equal(lp_kept, lp_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(g_kept, g_ckpt, strict=True))
    assert any(float(g.abs().max()) > 0 for g in g_kept)


# -- 5. the plain forward: a row's result depends on nothing but the row ---------------------------
def grouped_turn(vocab: int, groups: list[tuple[int, int]], resp_lens: list[int], seed: int) -> TurnTensors:
    """Rows of (context length, rows sharing it) groups; left-padded contexts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    contexts, responses = [], []
    for length, rows in groups:
        ctx = torch.randint(5, vocab, (length,), generator=g).tolist()
        contexts += [ctx] * rows
    for n in resp_lens[: len(contexts)]:
        responses.append(torch.randint(5, vocab, (n,), generator=g).tolist())
    return TurnTensors(*left_pad(contexts, 0), *right_pad(responses, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_sharing_its_call(dtype):
    """Different groupings of the same rows of a turn (subsets, orders, a context's rows split
    between calls, every row alone) give bit-identical hidden states and log-probs equal to the
    fp32 LM head's rounding (its one matmul may take another kernel for another number of rows on
    some CPUs: 4.8e-7 seen), with one base-model call per forward whatever its rows."""
    model = copy.deepcopy(load_agent("tiny", seed=0).model).to(dtype)
    groups = [(6, 4), (2, 4), (7, 4), (4, 4), (6, 2), (1, 3)]
    tensors = grouped_turn(model.config.vocab_size, groups, [1, 4, 2, 3, 4] * 5, 3)
    calls = []
    model.base_model.register_forward_pre_hook(lambda *_: calls.append(1))
    n = tensors.context_ids.shape[0]
    with torch.no_grad():
        whole, hidden = turn_forward(model, tensors, slice(None), 1.0)  # [N, Lr], [N, Lr, H]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        parts = [perm[:5], perm[5:12], perm[12:], torch.arange(n - 1, -1, -1), torch.tensor([3, 4])]
        for part in parts + [torch.tensor([i]) for i in range(n)]:
            lp, h = turn_forward(model, tensors, part, 1.0)
            assert torch.equal(h, hidden[part])
            torch.testing.assert_close(lp, whole[part], rtol=0, atol=2e-6)
    assert len(calls) == 1 + len(parts) + n
    assert float(whole.abs().max()) > 0


def test_log_probs_do_not_depend_on_whether_the_weights_require_grad():
    """The forward's positions are a strided slice of the hidden states: the LM head must not let
    torch pick its matmul kernel by the weight's requires_grad (the agent being trained) against the
    frozen agent that scored the rollout. Bit for bit, under no_grad and with gradients."""
    model = copy.deepcopy(load_agent("tiny", seed=0).model)
    tensors = grouped_turn(model.config.vocab_size, [(7, 4), (5, 4), (6, 4), (3, 4)] * 2, [4, 3, 2, 4] * 8, 1)
    with torch.no_grad():
        frozen = turn_forward(model.requires_grad_(False), tensors, slice(None), 1.0)[0]  # [32, Lr]
        trained = turn_forward(model.requires_grad_(True), tensors, slice(None), 1.0)[0]
    assert torch.equal(frozen, trained)
    assert torch.equal(turn_forward(model, tensors, slice(None), 1.0)[0].detach(), frozen)
    assert float(frozen.abs().max()) > 0
    empty = logprobs.head_logits(model, torch.zeros(0, 3, model.config.hidden_size))
    assert empty.shape == (0, 3, model.config.vocab_size)


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_fp32_stage_has_log_ratio_exactly_zero_before_the_first_step(tmp_path, protocol):
    """A whole fp32 stage: behaviour log-probs of the frozen agents over the rollout, training
    log-probs in shuffled micro-batches (12 rows, another chunking than the rollout's) of the agent
    whose weights now require grad: log r = 0 exactly at every agent's first step."""
    torch.manual_seed(0)
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol=protocol))
    cfg = small_config(tmp_path, protocol=protocol, minibatch_size=12, epochs=2)
    sampling = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              token_budget=cfg.token_budget)
    run = sat.RunState(team, trust_regions_for(cfg, 2), {}, random.Random(0), HF)
    record, _ = sat.sat_stage(run, arithmetic_problems(8, seed=1), cfg.core(), sampling)
    assert [step.train.step0_log_ratio_max for step in record.agents] == [0.0, 0.0]
