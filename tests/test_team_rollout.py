"""Agents, team protocols and the batched rollout, on tiny agents (same code as real checkpoints)."""
import json

import pytest
import torch

from harness.config import parse_agents, resolve_agent_spec
from harness.loading import build_char_tokenizer, load_agent, load_saved_agent, save_agent
from harness.math_grading import answers_match, majority_vote, math_team_config, vote_reward
from harness.tasks import arithmetic_problems
from logprobs import TurnTensors, batched_response_logprobs, chunks_by_budget, cut_at_eos, left_pad
from rollout import SamplingConfig, rollout
from scale.rollout_hf import HF
from scale.rollout_vllm import make_backend
from team import Agent, Problem, Team


@pytest.fixture(scope="module")
def tiny_agents():
    return [load_agent("tiny", seed=k) for k in range(3)]


def problems(n=4):
    return arithmetic_problems(n, seed=0, split="train")


# -- agent specs -----------------------------------------------------------------
def test_parse_agents_forms():
    specs = parse_agents("Qwen3-4B x3")
    assert [s.source for s in specs] == ["Qwen/Qwen3-4B"] * 3
    mixed = parse_agents("Qwen3-4B x2, Qwen3-8B")
    assert [s.source for s in mixed] == ["Qwen/Qwen3-4B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B"]
    tiny = parse_agents("tiny x3")
    assert len(tiny) == 3 and all(s.kind == "tiny" and s.tiny_layers == 4 for s in tiny)
    assert parse_agents("tiny-6L")[0].tiny_layers == 6
    assert parse_agents("org/some-model")[0].kind == "hub"


@pytest.mark.parametrize("bad,needle", [
    ("Qwen3-5B", "unknown agent 'Qwen3-5B'"),
    ("tiny x0", "at least 1"),
    ("", "empty --agents"),
    ("tiny x3 x2", "cannot parse agent entry"),
])
def test_parse_agents_errors(bad, needle):
    with pytest.raises(ValueError) as err:
        parse_agents(bad)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_local_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_agent_spec(str(tmp_path))


def test_hub_loading_offline_gives_clear_error(monkeypatch, tmp_path):
    """The loading-by-name path exists and is exercised up to the download."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(RuntimeError) as err:
        load_agent("Qwen3-4B")
    msg = str(err.value)
    assert "Qwen/Qwen3-4B" in msg and "local checkpoint folder" in msg and "\n" not in msg


def test_hub_offline_reads_the_environment_at_each_call_and_probes_an_endpoint_once(monkeypatch):
    import socket

    from harness import loading as loading_module

    probes = []

    def unreachable(address, timeout):
        probes.append(address)
        raise OSError("no route to host")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub-offline-probe.invalid")
    assert loading_module.hub_offline() and loading_module.hub_offline()
    assert probes == [("hub-offline-probe.invalid", 443)]  # one probe, then the cached answer
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert not loading_module.hub_offline()  # behind a proxy the client decides
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert loading_module.hub_offline()  # the flag wins, read at this call
    assert len(probes) == 1


# -- tiny agents go through the checkpoint path ----------------------------------------
def test_tiny_agent_save_load_round_trip(tmp_path, tiny_agents):
    agent = tiny_agents[0]
    save_agent(agent, tmp_path / "a")
    again = load_saved_agent(tmp_path / "a")
    for (n1, p1), (n2, p2) in zip(agent.model.state_dict().items(), again.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    msgs = [{"role": "user", "content": "23+15"}]
    assert again.encode_prompt(msgs) == agent.encode_prompt(msgs)
    assert again.tokenizer.get_vocab() == agent.tokenizer.get_vocab()
    assert again.spec.name == "tiny"
    # a saved folder is itself a valid --agents entry
    assert resolve_agent_spec(str(tmp_path / "a")).kind == "local"


@pytest.mark.parametrize("load", ["from_checkpoint", "load"])
def test_a_checkpoint_without_a_pad_token_pads_with_eos_on_the_left(tmp_path, tiny_agents, load):
    """team.prepare_tokenizer, whichever way a folder is loaded (load_agent of
    an --agents folder, load_saved_agent of a saved run): a tokenizer
    shipped without a pad token pads with its EOS, on the left."""
    agent = tiny_agents[0]
    save_agent(agent, tmp_path / "a")
    config = tmp_path / "a" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "pad_token"}))
    tok = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    tok["padding"] = None
    (tmp_path / "a" / "tokenizer.json").write_text(json.dumps(tok))
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path / "a").pad_token is None  # the folder really lacks one
    again = load_saved_agent(tmp_path / "a") if load == "from_checkpoint" else load_agent(str(tmp_path / "a"))
    assert again.tokenizer.pad_token == again.tokenizer.eos_token and again.tokenizer.padding_side == "left"
    batch = again.tokenizer(["1+1", "12+30"], padding=True)["input_ids"]
    assert batch[0][0] == again.tokenizer.eos_token_id  # the shorter prompt padded on the left


def test_tiny_seed_determines_weights():
    a, b, c = load_agent("tiny", seed=1), load_agent("tiny", seed=1), load_agent("tiny", seed=2)
    pa, pb, pc = (next(x.model.parameters()) for x in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_chat_template_tiny_and_thinking_switch(tiny_agents):
    agent = tiny_agents[0]
    text = agent.render_prompt([{"role": "user", "content": "12+13"}])
    assert text == "<|user|>12+13<|assistant|>"
    ids = agent.encode_prompt([{"role": "user", "content": "12+13"}])
    assert ids[0] == agent.tokenizer.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == agent.tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 2 + len("12+13")  # one token per character, role markers atomic
    # Qwen3's template reads `enable_thinking`; ours must pass it through
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
                         "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")
    thinking_agent = Agent(agent.spec, agent.model, tok)
    one = [{"role": "user", "content": "1"}]
    assert thinking_agent.render_prompt(one, enable_thinking=False).endswith("<think></think>")
    assert not thinking_agent.render_prompt(one, enable_thinking=True).endswith("</think>")


def test_freeze_and_optimizer_only_when_training(tiny_agents):
    agent = load_agent("tiny", seed=5)
    assert agent.optimizer is None and not any(p.requires_grad for p in agent.model.parameters())
    agent.start_training(1e-3)
    assert agent.optimizer is not None and all(p.requires_grad for p in agent.model.parameters())
    agent.freeze()
    assert agent.optimizer is None and not any(p.requires_grad for p in agent.model.parameters())


# -- protocols -------------------------------------------------------------------------------
def test_team_answer_rules(tiny_agents):
    indep = Team(tiny_agents, math_team_config(protocol="independent"))
    chain = Team(tiny_agents, math_team_config(protocol="chain"))
    assert indep.team_answer(["5", "7", "05"]) == "5"  # majority after normalisation
    assert indep.team_answer(["5", "7", None]) == "5"  # tie -> earliest agent
    assert indep.team_answer(["5", "7", None]) == majority_vote(["5", "7", None])
    assert chain.team_answer(["5", "5", "7"]) == "7"  # the last agent speaks for the team
    with pytest.raises(ValueError, match="unknown protocol"):
        Team(tiny_agents, math_team_config(protocol="debate"))


def test_chain_prompt_contains_earlier_answers(tiny_agents):
    chain = Team(tiny_agents, math_team_config(protocol="chain"))
    p = Problem("x", "12+13", "25")
    assert chain.user_message(p, []) == "12+13"
    assert chain.user_message(p, ["25", None]) == "12+13\nAgent 1: 25\nAgent 2: ?\n"
    indep = Team(tiny_agents, math_team_config(protocol="independent"))
    assert indep.user_message(p, ["25"]) == "12+13"


@pytest.mark.parametrize("protocol", ["independent", "chain"])
def test_rollout_both_protocols(tiny_agents, protocol):
    torch.manual_seed(0)
    team = Team(tiny_agents, math_team_config(protocol=protocol))
    ps = problems(3)
    batch = rollout(team, ps, group_size=4, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6), backend=HF)
    n = 12
    assert len(batch) == n and batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert [t.agent for t in batch.turns] == [0, 1, 2]
    for t in batch.turns:
        assert t.response_ids.shape == t.response_mask.shape == t.behaviour_logprobs.shape
        assert t.response_mask.sum(1).min() >= 1 and t.response_mask.sum(1).max() <= 6
        assert (t.behaviour_logprobs[t.response_mask == 0] == 0).all()
        assert (t.behaviour_logprobs[t.response_mask == 1] < 0).all()
        assert len(t.texts) == len(t.answers) == n
    for i in range(n):
        answers = [t.answers[i] for t in batch.turns]
        assert batch.team_answers[i] == team.team_answer(answers)
        gold = batch.problems[i].answer
        if protocol == "chain":
            assert batch.rewards[i].item() == float(answers_match(batch.team_answers[i], gold))
        else:  # expected correctness of the vote under a uniform tie-break
            assert batch.rewards[i].item() == pytest.approx(vote_reward(answers, gold))
    tok = team.agents[2].tokenizer
    ctx = tok.decode(batch.turns[2].context_ids[0][batch.turns[2].context_mask[0].bool()])
    if protocol == "chain":  # agent 3 read agents 1 and 2's answers of the same joint trajectory
        a1 = batch.turns[0].answers[0] or "?"
        assert f"Agent 1: {a1}\n" in ctx and "Agent 2: " in ctx
    else:
        assert "Agent 1" not in ctx


# -- log-probabilities -----------------------------------------------------------------------
def test_behaviour_logprobs_equal_fresh_unpadded_forward(tiny_agents):
    torch.manual_seed(1)
    team = Team(tiny_agents, math_team_config(protocol="chain"))
    batch = rollout(team, problems(4), group_size=2, sampling=SamplingConfig(temperature=0.8, max_new_tokens=8),
                    backend=HF)
    for turn in batch.turns:
        model = team.agents[turn.agent].model
        for i in range(len(batch)):
            ctx = turn.context_ids[i][turn.context_mask[i].bool()]
            resp = turn.response_ids[i][turn.response_mask[i].bool()]
            with torch.no_grad():
                logits = model(torch.cat([ctx, resp])[None]).logits[0, len(ctx) - 1 : -1] / 0.8
            fresh = torch.log_softmax(logits.float(), -1).gather(-1, resp[:, None]).squeeze(-1)
            assert torch.allclose(fresh, turn.behaviour_logprobs[i, : len(resp)], atol=1e-5, rtol=0)


def test_behaviour_logprobs_equal_sampling_distribution(tiny_agents):
    """The teacher-forced log-probs are those of the distribution generate sampled from."""
    from transformers import GenerationConfig

    agent = tiny_agents[1]
    tok = agent.tokenizer
    contexts = [agent.encode_prompt([{"role": "user", "content": p.problem}]) for p in problems(6)]
    contexts[0] = contexts[0][:3] + contexts[0]  # uneven lengths -> real left padding
    ids, mask = left_pad(contexts, tok.pad_token_id)
    torch.manual_seed(2)
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=5,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    out = agent.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                               return_dict_in_generate=True, output_logits=True)
    sampled = out.sequences[:, ids.shape[1]:]  # [N, T]
    step_logp = torch.stack([torch.log_softmax(x.float() / 0.7, -1) for x in out.logits], 1)  # [N, T, V]
    gen_logp = step_logp.gather(-1, sampled[..., None]).squeeze(-1)  # [N, T]
    responses = [cut_at_eos(r.tolist(), tok.eos_token_id) for r in sampled]
    from logprobs import right_pad
    resp, rmask = right_pad(responses, tok.pad_token_id)
    ours = batched_response_logprobs(agent.model, TurnTensors(ids, mask, resp, rmask), 0.7, token_budget=10_000)
    for i, r in enumerate(responses):
        assert torch.allclose(ours[i, : len(r)], gen_logp[i, : len(r)], atol=1e-5, rtol=0)


def test_logprob_chunking_is_exact(tiny_agents):
    torch.manual_seed(3)
    team = Team(tiny_agents, math_team_config())
    batch = rollout(team, problems(5), group_size=3, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6),
                    backend=HF)
    t = batch.turns[0]
    small = batched_response_logprobs(team.agents[0].model, t.tensors, 1.0, token_budget=20)  # 1 row per chunk
    assert torch.allclose(small, t.behaviour_logprobs, atol=1e-6)


def test_turn_tensors_name_a_turns_tensors_and_select_rows(tiny_agents):
    team = Team(tiny_agents, math_team_config())
    batch = rollout(team, problems(3), group_size=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=4),
                    backend=HF)
    t = batch.turns[1]
    ctx, cmask, resp, rmask = t.tensors  # still a tuple, in this order
    assert TurnTensors._fields == ("context_ids", "context_mask", "response_ids", "response_mask")
    assert all(a is getattr(t, name) for a, name in zip((ctx, cmask, resp, rmask), TurnTensors._fields, strict=True))
    idx = torch.tensor([4, 0, 2])
    part = t.tensors.rows(idx)
    for name in TurnTensors._fields:
        assert torch.equal(getattr(part, name), getattr(t, name)[idx])


def test_chunks_by_budget_cover_and_fit():
    lengths = [3, 5, 5, 9, 2, 2, 2, 8]
    slices = chunks_by_budget(lengths, budget=12)
    covered = [i for s in slices for i in range(s.start, s.stop)]
    assert covered == list(range(len(lengths)))
    for s in slices:
        rows = lengths[s]
        assert len(rows) == 1 or len(rows) * max(rows) <= 12


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top-p"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="unknown backend 'tgi'"):
        make_backend("tgi", 1, 0)
    assert make_backend("hf", 3, 0) is HF  # stateless: nothing to start or stop


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 1, 0, 0], eos_id=1) == [5, 6, 1]  # what follows the first eos is padding
    assert cut_at_eos([5, 6, 7], eos_id=1) == [5, 6, 7]
    assert cut_at_eos([5, 0, 0], eos_id=1) == [5, 0, 0]  # truncated: sampled pad ids (pad 0 != eos 1) stay
