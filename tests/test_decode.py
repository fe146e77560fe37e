"""``scale.rollout_hf.decode``: sampling that forwards only the rows not yet ended draws exactly what HF ``generate``
draws with the same ``SeededSampler``, and forwards each row once per token it keeps; a response is cut only after
its first eos (``logprobs.cut_at_eos``)."""
import copy
from types import SimpleNamespace

import torch
from transformers import LogitsProcessorList

from harness.loading import load_agent
from harness.math_grading import math_team_config
from harness.tasks import arithmetic_problems
from logprobs import cut_at_eos, left_pad
from rollout import SamplingConfig, behaviour_logprobs, response_seeds, rollout
from scale.rollout_hf import HF, SeededSampler, decode, drops_rows, sampler_config
from team import Agent, Team

MAX_NEW = 24


def batch(agent: Agent, n: int = 32):
    """Left-padded prompts of several lengths and their seeds; an untrained tiny agent ends about a quarter of
    them with eos inside ``MAX_NEW`` tokens, at different steps."""
    contexts = [agent.encode_prompt([{"role": "user", "content": f"{a}+{a * 7 % 13}" * (1 + a % 3)}]) for a in range(n)]
    return (*left_pad(contexts, agent.tokenizer.pad_token_id), response_seeds(7, n, 0))


def test_decode_draws_what_generate_draws_and_forwards_only_live_rows():
    agent = load_agent("tiny", seed=0)
    model = copy.deepcopy(agent.model).double()  # float64: a smaller batch cannot flip a token by rounding
    tok, ids, mask, seeds = agent.tokenizer, *batch(agent)
    rows_forwarded = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows_forwarded.append(kw["input_ids"].shape),
                                           with_kwargs=True)
    ours = decode(model, ids, mask, SeededSampler(seeds, 1.0), MAX_NEW, tok.eos_token_id, tok.pad_token_id)
    hook.remove()
    gen_cfg = sampler_config(agent, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW))
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                            logits_processor=LogitsProcessorList([SeededSampler(seeds, 1.0)]))[:, ids.shape[1]:]
    cut = lambda t: [cut_at_eos(r.tolist(), tok.eos_token_id) for r in t]  # noqa: E731
    responses = cut(ours)
    assert responses == cut(theirs)
    lengths = [len(r) for r in responses]
    ended = sum(r[-1] == tok.eos_token_id for r in responses)
    assert 0 < ended < len(responses) and len(set(lengths)) > 2  # rows really ended at different steps
    assert rows_forwarded[0] == ids.shape  # one prefill of every row
    assert all(s[1] == 1 for s in rows_forwarded[1:])  # then one token per live row per step
    assert sum(s[0] for s in rows_forwarded[1:]) == sum(n - 1 for n in lengths)  # no step on an ended row

    done = [i for i, r in enumerate(responses) if r[-1] == tok.eos_token_id]  # rows that all end: decoding stops
    alone = decode(model, ids[done], mask[done], SeededSampler([seeds[i] for i in done], 1.0), MAX_NEW,
                   tok.eos_token_id, tok.pad_token_id)  # at the last one's eos
    assert cut(alone) == [responses[i] for i in done] and alone.shape[1] == max(lengths[i] for i in done)


def test_only_attention_caches_drop_rows():
    """Attention layers (full or sliding window) can lose rows; a model with linear-attention or state-space
    layers, whose recurrent state ``batch_select_indices`` does not cut, samples through ``generate``."""
    from transformers import FalconH1Config, LlamaConfig, Qwen3Config, Qwen3NextConfig

    sliding = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert all(drops_rows(SimpleNamespace(config=c)) for c in (Qwen3Config(), LlamaConfig(), sliding))
    assert not any(drops_rows(SimpleNamespace(config=c)) for c in (Qwen3NextConfig(), FalconH1Config()))


def test_a_truncated_response_keeps_its_sampled_pad_ids():
    """A response without eos keeps every id it sampled, pad ids included (the tiny tokenizer's pad is not its eos,
    as Qwen's <|endoftext|> is not its <|im_end|>): each is an action, a factor of the ratio and the KL, so the
    turn's response mask covers it and its behaviour log-prob is the teacher-forced one. 512 one-token and 512
    two-token rows of an untrained tiny agent (102 ids): about 1 in 100 ends on a sampled pad, 11 here (the draws
    are seeded: the same on any CPU but for near-ties)."""
    agent = load_agent("tiny", seed=0)
    tok = agent.tokenizer
    assert tok.pad_token_id != tok.eos_token_id
    team = Team([agent, load_agent("tiny", seed=1)], math_team_config())
    found = 0
    for max_new in (1, 2):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new)
        turn = rollout(team, arithmetic_problems(64, seed=max_new), 8, sampling, HF).turns[0]
        lengths = turn.response_mask.sum(1)  # [N]
        assert (lengths >= 1).all()  # a response holds at least the one token it sampled
        last = turn.response_ids.gather(1, (lengths - 1)[:, None])[:, 0]  # [N] each row's last kept id
        on_pad = last == tok.pad_token_id  # [N]
        found += int(on_pad.sum())
        assert (lengths[on_pad] == max_new).all() and turn.truncated[on_pad].all()  # truncated, kept whole
        assert (turn.response_mask.sum(1) == turn.response_mask.cumprod(1).sum(1)).all()  # the mask is a prefix
        rows = on_pad.nonzero()[:, 0]  # [n]
        if len(rows) == 0:
            continue
        fresh = behaviour_logprobs(agent, turn.tensors.rows(rows), sampling)  # [n, Lr] teacher forced
        kept = turn.behaviour_logprobs[rows].gather(1, (lengths[rows] - 1)[:, None])  # [n, 1] the pad's log-prob
        assert torch.isfinite(kept).all() and (kept < 0).all()
        torch.testing.assert_close(kept, fresh.gather(1, (lengths[rows] - 1)[:, None]))
    assert found > 0
