"""Plug-and-play: Stage-0 alignment of a replacement agent and continuing SAT (paper, Section 5, Eqs. (6)-(7))."""
import copy
import json
import shutil

import pytest
import torch

import harness.cli
import harness.run
import plug_and_play
import stage0_states
from harness.config import Config
from harness.loading import load_agent, load_saved_team
from harness.math_grading import math_team_config
from harness.run_folder import latest_checkpoint
from harness.tasks import arithmetic_problems
from kl_projection import geometric_mixture_at
from logprobs import measure_kl
from rollout import SamplingConfig, rollout
from scale.rollout_hf import HF
from team import Team, check_same_vocabulary
from trust_region import kl_from_logprobs, quantile

QUIET = dict(log=lambda *_: None)


def small_config(tmp_path, **overrides) -> Config:
    cfg = dict(agents="tiny x2", stages=1, batch_size=32, group_size=4, epochs=1, minibatch_size=16,
               warmup_steps=30, eval_size=16, out=str(tmp_path / "run"), device="cpu")
    cfg.update(overrides)
    return Config(**cfg).apply_preset()


@pytest.mark.slow  # over 10 s on two busy cores: Stage-0 on a tiny team's rollouts
def test_stage0_brings_replacement_inside_delta0(tmp_path):
    torch.manual_seed(0)
    cfg = small_config(tmp_path, stage0_delta=0.05, stage0_fit_tol=0.3)
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))
    replacement = load_agent("tiny-3L", seed=9)  # another architecture, same vocabulary
    problems = arithmetic_problems(8, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    before = [copy.deepcopy(a.model.state_dict()) for a in team.agents]
    info = plug_and_play.stage0_align(team, 1, replacement, problems, cfg, sampling, lr=1e-3, backend=HF,
                                      **QUIET).record
    assert info["kl_quantile_before"] > cfg.stage0_delta  # it really had to move
    assert info["kl_quantile"] <= cfg.stage0_delta and info["passes"] >= 1
    assert info["heldout_states"] > 0 and info["template_differs"] == 0 and info["fit_mean"] < info["fit_mean_before"]
    # measure independently on fresh states of the same team
    batch = rollout(team, problems, 4, sampling, HF)
    kl, _, _ = measure_kl(replacement, team.agents[1].model, batch.turns[1], 1.0, 1 << 14)
    assert quantile(kl, cfg.quantile) <= 3 * cfg.stage0_delta  # new states: inside up to sampling noise
    for agent, state in zip(team.agents, before):  # Stage-0 trains only the replacement
        for name, tensor in agent.model.state_dict().items():
            assert torch.equal(tensor, state[name])


def test_vocabulary_mismatch_is_refused():
    incumbent = load_agent("tiny", seed=0)
    other = load_agent("tiny", seed=1)
    other.tokenizer.add_tokens(["<|extra|>"])
    other.model.resize_token_embeddings(len(other.tokenizer))
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(incumbent, other)
    msg = str(err.value)
    assert "vocabularies differ" in msg and "102 tokens" in msg and "103 tokens" in msg and "\n" not in msg
    team = Team([incumbent, load_agent("tiny", seed=2)], math_team_config())
    with pytest.raises(ValueError, match="vocabularies differ"):
        team.swap(0, other)
    assert team.agents[0] is incumbent


@pytest.mark.slow  # over 10 s on two busy cores: a run, an upgrade and a resume
def test_upgrade_run_keeps_others_bit_identical_records_and_resumes(tmp_path, one_stage_tiny_run):
    run_dir = tmp_path / "run"
    shutil.copytree(one_stage_tiny_run, run_dir)  # the run of small_config(stages=1), made once in conftest
    assert json.loads((run_dir / "config.json").read_text())["agents"] == small_config(tmp_path).agents  # as given
    before = load_saved_team(latest_checkpoint(run_dir) / "team")
    cfg = harness.cli.parse_args(["--resume", str(run_dir), "--upgrade", "2=tiny-3L", "--stages", "1",
                          "--stage0-delta", "0.05", "--upgrade-warmup-steps", "20"])
    harness.run.run(cfg, **QUIET)
    upgraded = load_saved_team(latest_checkpoint(run_dir) / "team")
    assert latest_checkpoint(run_dir).name == "stage_0001_upgraded"
    # the untouched agent is bit-identical; the slot holds the new 3-layer model
    for name, tensor in upgraded.agents[0].model.state_dict().items():
        assert torch.equal(tensor, before.agents[0].model.state_dict()[name])
    assert upgraded.agents[1].model.config.num_hidden_layers == 3
    assert json.loads((latest_checkpoint(run_dir) / "team" / "team.json").read_text())["agents"] == ["tiny", "tiny-3L"]
    events = json.loads((run_dir / "upgrades.json").read_text())
    assert events[0]["slot"] == 2 and events[0]["from"] == "tiny" and events[0]["to"] == "tiny-3L"
    assert events[0]["at_stage"] == 1
    assert events[0]["stage0"]["kl_quantile"] <= 0.05
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["upgrade"] == [] and saved["agents"] == "tiny, tiny-3L"  # the team as it now is
    # continue SAT with the upgraded team: the checkpoint resumes
    more = harness.run.run(harness.cli.parse_args(["--resume", str(run_dir), "--stages", "2"]), **QUIET)
    assert [r["stage"] for r in more] == [0, 1, 2]
    assert more[-1]["upgrades"][0]["to"] == "tiny-3L"
    assert len(more[-1]["agents"]) == 2


# ---------------------------------------------------------------------------
# Stage-0 on small random models, where Eq. (7) is computable exactly
# ---------------------------------------------------------------------------
def random_lm(vocab=40, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


def random_states(rows, lc, lr, tokens, seed):
    """Random sequences over the first ``tokens`` ids: held-out states come from the same distribution."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, tokens, (rows, lc), generator=g)
    resp = torch.randint(0, tokens, (rows, lr), generator=g)
    ones_c, ones_r = torch.ones_like(ctx), torch.ones_like(resp)
    return stage0_states.Stage0States(ctx, ones_c, ctx, ones_c, resp, ones_r)


@torch.no_grad()
def full_logp(model, st):
    """log pi(.|s) at every response position from the plain HF forward (not Stage-0's path). [M, V]"""
    lc = st.ctx_new.shape[1]
    logits = model(input_ids=torch.cat([st.ctx_new, st.resp], 1)).logits[:, lc - 1 : -1]  # [N, Lr, V]
    return torch.log_softmax(logits.double(), -1).reshape(-1, logits.shape[-1])  # [M, V]


def settings(delta0, lr, max_passes, fit_tol, rows_per_step=16):
    """Stage-0 on the random LMs below: the 0.99 quantile, temperature 1, whole rows per trunk call."""
    return plug_and_play.Stage0Settings(delta0, 0.99, lr, max_passes, fit_tol, temperature=1.0,
                                        rows_per_step=rows_per_step, token_budget=4096)


def kl_rows(p, q):
    return (p.exp() * (p - q)).sum(-1)  # [M]


def test_stage0_kl_is_the_trust_regions_exact_kl_bit_for_bit():
    """Stage-0's KLs are ``trust_region.kl_from_logprobs`` (its 0 log 0 guard): on finite log-probs the plain
    sum_v p (log p - log q), bit for bit per state, and the fit loss's gradient bit for bit; the fit loss's value
    (row sums, then their sum) only up to float summation order (measured: 1.5e-7 relative, 3e-5 absolute)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.log_softmax(30 * torch.randn(7, 1000, generator=g), -1) for _ in range(2))  # [7, 1000]
    assert bool((a.exp() == 0).any())  # tokens of probability 0 in fp32: where the guard acts
    assert torch.equal(kl_from_logprobs(a, b), (a.exp() * (a - b)).sum(-1))
    heads = [torch.nn.Linear(8, 1000, bias=False) for _ in range(3)]  # new, pre, cur
    h = [torch.randn(7, 8, generator=g) for _ in range(3)]  # [7, H]
    t = torch.rand(7, generator=g)  # [7]
    grads, values = [], []
    for piece in (plug_and_play._fit_piece, inline_fit_piece):
        h_new = h[0].clone().requires_grad_(True)
        loss = piece(*heads, h_new, h[1], h[2], t, 0.7)
        loss.backward()
        grads.append(h_new.grad)
        values.append(float(loss.detach()))
    assert torch.equal(grads[0], grads[1])
    assert abs(values[0] - values[1]) <= 1e-6 * abs(values[1])


def inline_fit_piece(head_new, head_pre, head_cur, h_new, h_pre, h_cur, t, temperature):
    """Stage-0's fit loss on a block with the KL written out: the reference for the test above."""
    with torch.no_grad():
        lp_pre, lp_cur = (torch.log_softmax(hd(x).float() / temperature, -1) for hd, x in ((head_pre, h_pre),
                                                                                          (head_cur, h_cur)))
        target = geometric_mixture_at(lp_pre, lp_cur, t)  # [c, V]
    logp_new = torch.log_softmax(head_new(h_new).float() / temperature, -1)  # [c, V]
    return (target.exp() * (target - logp_new)).sum()


@pytest.mark.slow  # a Stage-0 fit of up to 300 passes
def test_stage0_matches_the_closed_form_projection_and_holds_on_heldout_states():
    """pi_pre and pi_cur share a trunk and differ in the LM head, so Eq. (7)'s
    targets are (nearly) representable; after Stage-0 the per-state
    distributions must match the exact targets within the stated tolerance, stay
    inside delta_0 on states the fit never saw, and keep what pi_pre knows
    (closer to pi_pre than the incumbent is)."""
    from kl_projection import geometric_mixture_projection

    cur = random_lm(seed=1)
    pre = copy.deepcopy(cur)
    torch.manual_seed(2)
    pre.lm_head.weight.data += 0.6 * torch.randn_like(pre.lm_head.weight)
    fit, held = random_states(48, 3, 6, 6, seed=3), random_states(16, 3, 6, 6, seed=4)
    kl_pre = kl_rows(full_logp(pre, fit), full_logp(cur, fit))
    delta0 = float(kl_pre.median())  # about half the states violate
    new = copy.deepcopy(pre)
    fitted = plug_and_play.fit_stage0(new, cur, fit, held, settings(delta0, lr=1e-2, max_passes=300, fit_tol=0.1))
    info = fitted.record
    assert info["share_outside_before"] > 0.3 and info["kl_quantile_before"] > delta0
    assert info["fit_ok"] and info["passes"] >= 1
    # the exact targets at delta_0, computed independently: Stage-0 solved the same lambda(s)
    lp_new, lp_pre, lp_cur = full_logp(new, fit), full_logp(pre, fit), full_logp(cur, fit)
    exact, lam = geometric_mixture_projection(lp_pre, lp_cur, delta0)
    t_exact = torch.where(torch.isinf(lam), torch.zeros_like(lam), 1 / (1 + lam))  # [M]
    assert torch.allclose(fitted.t_exact.double(), t_exact, atol=1e-4)
    # a state keeps its exact target unless the fit left it outside; then its t only shrank (deeper inside)
    moved = fitted.t < fitted.t_exact  # [M]
    assert abs(float(moved.double().mean()) - info["retargeted"]) < 1e-6
    assert bool((fitted.t <= fitted.t_exact).all())
    target = geometric_mixture_at(lp_pre, lp_cur, fitted.t.double())  # [M, V] what was fitted
    assert bool((kl_rows(target, lp_cur) <= delta0 + 1e-6).all())  # every target is feasible
    fit_kl = kl_rows(target, lp_new)
    start_kl = kl_rows(exact, lp_pre)
    assert abs(info["fit_tol"] - 0.1 * float(start_kl.mean())) < 1e-5  # the stated (relative) tolerance
    assert float(fit_kl.mean()) <= info["fit_tol"] * 1.01 + 1e-7
    assert abs(float(fit_kl.mean()) - info["fit_mean"]) < 1e-4
    assert quantile(fit_kl, 0.99) <= 10 * info["fit_tol"]  # per state too, not only on average
    assert float(kl_rows(target, lp_pre).mean()) > 5 * float(fit_kl.mean())  # pi_new far closer to the targets
    if not bool(moved.all()):  # the states still aimed at the exact argmin are fitted to it
        assert float(kl_rows(exact, lp_new)[~moved].mean()) <= info["fit_tol"] * 1.01 + 1e-7
    # the constraint: in sample, and on held-out states
    assert quantile(kl_rows(lp_new, lp_cur), 0.99) <= delta0 + 1e-6
    kl_held = kl_rows(full_logp(new, held), full_logp(cur, held))
    assert quantile(kl_held, 0.99) <= delta0
    assert abs(quantile(kl_held, 0.99) - info["heldout_kl_quantile"]) < 1e-4
    # the argmin keeps pi_pre's information: pi_new is much closer to pi_pre than pi_cur is
    assert float(kl_rows(lp_new, lp_pre).mean()) < 0.5 * float(kl_rows(lp_cur, lp_pre).mean())


def test_stage0_is_the_identity_when_pi_pre_is_already_inside():
    cur = random_lm(seed=1)
    pre = copy.deepcopy(cur)
    pre.lm_head.weight.data += 0.05 * torch.randn_like(pre.lm_head.weight)
    fit, held = random_states(8, 3, 6, 6, seed=3), random_states(4, 3, 6, 6, seed=4)
    new = copy.deepcopy(pre)
    info = plug_and_play.fit_stage0(new, cur, fit, held, settings(10.0, lr=1e-2, max_passes=5, fit_tol=0.05)).record
    assert info["passes"] == 0 and info["share_outside_before"] == 0.0 and info["fit_mean"] <= 1e-6
    for a, b in zip(new.parameters(), pre.parameters()):
        assert torch.equal(a, b)


def test_stage0_raises_a_clear_error_when_it_cannot_reach_delta0():
    """A budget too small to move a far-away pi_pre inside a tiny ball: a clear
    one-line error naming the fix, never a model outside delta_0."""
    cur = random_lm(seed=1)
    pre = copy.deepcopy(cur)
    pre.lm_head.weight.data += 2.0 * torch.randn_like(pre.lm_head.weight)
    fit, held = random_states(8, 3, 4, 6, seed=3), random_states(4, 3, 4, 6, seed=4)
    with pytest.raises(RuntimeError, match=r"could not bring agent inside delta_0=0.001: KL quantile still .* "
                                           r"after 3 passes; raise --stage0-delta or --stage0-max-passes"):
        plug_and_play.fit_stage0(copy.deepcopy(pre), cur, fit, held, settings(1e-3, lr=1e-3, max_passes=3, fit_tol=0.1))


def test_stage0_of_a_bf16_replacement_keeps_fp32_master_weights():
    """A bf16 replacement (GPU runs) trains through fp32 masters, as the SAT
    update does (team.MasterWeightAdamW): at a small lr most steps are below a
    bf16 rounding step, so only the master holds them; they come back in
    the result (here: the error's ``fit``) for the agent's first turn, every bf16 weight is round(master),
    and no gradient hook is left on the weights."""
    cur = random_lm(seed=1).to(torch.bfloat16)
    pre = copy.deepcopy(cur)
    pre.lm_head.weight.data += 2.0 * torch.randn_like(pre.lm_head.weight)
    fit, held = random_states(8, 3, 4, 6, seed=3), random_states(4, 3, 4, 6, seed=4)
    new = copy.deepcopy(pre)
    with pytest.raises(plug_and_play.Stage0Unreachable, match="could not bring agent inside") as err:  # 3 passes
        plug_and_play.fit_stage0(new, cur, fit, held,
                                 settings(1e-3, lr=1e-5, max_passes=3, fit_tol=0.1, rows_per_step=4))
    masters, params, start = err.value.fit.master_weights, list(new.parameters()), list(pre.parameters())
    assert [m.shape for m in masters] == [p.shape for p in params] and all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(masters, params))  # bf16 weight = round(master)
    moved = torch.cat([(m != s.float()).flatten() for m, s in zip(masters, start)])  # the masters stepped
    kept = torch.cat([(p == s).flatten() for p, s in zip(params, start)])  # the bf16 weights did not
    assert float(moved.float().mean()) > 0.8  # measured 0.91
    assert float((moved & kept).float().mean()) > 0.4  # only the master holds these steps: measured 0.51
    new.requires_grad_(True)
    new(input_ids=fit.ctx_new).logits.float().sum().backward()
    assert all(p.grad is not None for p in new.parameters())  # no master hook took the gradient away


def test_stage0_renders_the_replacements_own_template_and_says_when_it_differs():
    team = Team([load_agent("tiny", seed=k) for k in range(2)], math_team_config(protocol="chain"))
    problems = arithmetic_problems(4, seed=0)
    batch = rollout(team, problems, 2, SamplingConfig(temperature=1.0, max_new_tokens=2), HF)
    same = load_agent("tiny-3L", seed=9)
    states, differ = stage0_states.slot_states(team, 1, same, batch)
    assert differ == 0 and torch.equal(states.ctx_new, states.ctx_cur)
    other = load_agent("tiny", seed=9)
    other.tokenizer.chat_template = "<|system|>Be brief." + other.tokenizer.chat_template
    states, differ = stage0_states.slot_states(team, 1, other, batch)
    assert differ == len(batch)
    prefix = other.tokenizer("<|system|>Be brief.", add_special_tokens=False)["input_ids"]
    for row in range(len(batch)):
        ctx = states.ctx_new[row][states.cmask_new[row].bool()].tolist()
        old = batch.turns[1].context_ids[row][batch.turns[1].context_mask[row].bool()].tolist()
        assert ctx == prefix + old  # the same messages (with agent 1's answer), in the replacement's template
    assert torch.equal(states.resp, batch.turns[1].response_ids)


PEAK_SCRIPT = r"""
import sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
import plug_and_play as pp
import stage0_states

def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

length, budget = int(sys.argv[1]), int(sys.argv[2])
cfg = Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
torch.manual_seed(0)
new, cur, pre = Qwen3ForCausalLM(cfg).eval(), Qwen3ForCausalLM(cfg).eval(), Qwen3ForCausalLM(cfg).eval()
new.requires_grad_(True)
g = torch.Generator().manual_seed(0)
ctx, resp = torch.randint(0, 151936, (2, 4), generator=g), torch.randint(0, 151936, (2, length), generator=g)
st = stage0_states.Stage0States(ctx, torch.ones_like(ctx), ctx, torch.ones_like(ctx), resp, torch.ones_like(resp))
opt = torch.optim.SGD(new.parameters(), lr=1e-3)
open("/proc/self/clear_refs", "w").write("5")  # reset the RSS high-water mark
before = status_kb("VmRSS")
t = torch.zeros(2 * length)  # targets = pi_cur: a real gradient
# token_budget 1: one row per micro-batch, so a longer response means more positions in one row
s = pp.Stage0Settings(0.01, 0.99, 1e-3, 1, 0.1, temperature=1.0, rows_per_step=2, token_budget=1, logits_budget=budget)
pp.fit_pass(new, pre, cur, st, t, opt, s)
pp.measure_stage0(new, pre, cur, st, t, s)
print((status_kb("VmHWM") - before) / 1024)
"""


@pytest.mark.slow  # over half a minute: two Stage-0 processes with a Qwen3-sized head
def test_stage0_peak_memory_is_flat_in_the_response_length():
    """Stage-0 with a Qwen3-sized vocabulary (151,936-row head on a tiny trunk):
    the peak RSS increase of a fit pass + a measurement pass stays flat when the
    responses grow 4x (measured on a loaded 2-core machine: 43.1 -> 43.5 MB; the
    same script with an unlimited logits budget, i.e. no position chunks: 211 -> 767 MB)."""
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the RSS high-water mark (Linux)")
    # a fixed mmap threshold: glibc otherwise raises it after frees and keeps freed blocks in the
    # heap, so the RSS high-water mark would measure fragmentation instead of live memory
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    peaks = []
    for length in (32, 128):  # 3 positions of the 151,936-row head per block (1 << 19 elements)
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(length), str(1 << 19)], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks.append(float(out.stdout.strip().splitlines()[-1]))
    short, long = peaks
    assert long - short < 40, f"peak grew from {short:.0f} MB to {long:.0f} MB with 4x longer responses"
