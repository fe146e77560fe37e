"""The team: agents (one causal LM each) and the factorized team policy.

Paper, Section 3: a team of n agents is one factorized policy pi(a|s) = prod_i pi_i(a_i|s); each
agent's action is a whole response. Protocols: ``independent`` (every agent answers alone; the team
answer is the majority vote of their answers) and ``chain`` (agent k also sees the extracted answers of
agents 1..k-1, or with an environment their whole responses; the last agent's answer is the team answer).
How an answer is read from a response, how answers vote and the team reward R are the task's: the entry
point hands them in (``TeamConfig``).

A bf16 agent trains on fp32 master weights (``MasterWeightAdamW``). Agents are built, loaded and saved
by ``harness.loading``; this module holds no file I/O.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from adapter import Adapter, own_parameters
from harness.processes import ONE_PROCESS, OneProcess
from reward import Reward

PROTOCOLS = ("independent", "chain")


@dataclass(frozen=True)
class AgentSpec:
    """What to load for one team slot. ``kind`` is tiny | hub | local | gguf."""

    name: str  # as the user wrote it, e.g. "Qwen3-4B"
    kind: str
    source: str  # hub id, folder path, GGUF file path, or "tiny"
    tiny_layers: int = 4


@dataclass(frozen=True)
class Problem:
    """A problem the team answers: its text and the gold answer the reward checks against; a chat prompt's
    system turn, and the row's other columns (raw values, as a data file stores them), which the reward
    function receives by keyword."""

    id: str
    problem: str
    answer: str
    system: str | None = None
    columns: dict = field(default_factory=dict, hash=False)

ENCODE_CACHE_SIZE = 1 << 16  # entries per agent and cache
ADAMW_BETAS = (0.9, 0.99)  # AdamW's (beta1, beta2): every agent's update and Stage-0's fit
VALUE_HEAD_LR_SCALE = 10  # the value head's (--adv gae) learning rate, as a multiple of its agent's


def param_groups(params: list, extra: list, lr: float) -> list[dict]:
    """AdamW's parameter groups: the agent's weights at ``lr``; ``extra`` (a value head, --adv gae), if any, at
    VALUE_HEAD_LR_SCALE x ``lr``."""
    return [{"params": params, "lr": lr}] + ([{"params": extra, "lr": VALUE_HEAD_LR_SCALE * lr}] if extra else [])


class Agent:
    """One team member: a causal LM, its tokenizer, and (only while it is the agent being trained)
    an optimizer. Frozen agents hold no gradients and no optimizer state: SAT's memory advantage. With an
    ``adapter`` (--lora) the model is a shared base plus this agent's LoRA layers, and only those train."""

    def __init__(self, spec: AgentSpec, model, tokenizer, procs: OneProcess = ONE_PROCESS,
                 adapter: Adapter | None = None):
        self.spec = spec
        self.adapter = adapter
        self.base: Agent | None = None  # --lora: the whole agent whose weights this one's model shares
        self.model = model
        self.tokenizer = tokenizer
        self.procs = procs  # the processes its computation is spread over (processes.py: the scale-out seam)
        self.optimizer: torch.optim.Optimizer | None = None
        self.saved_optimizer_state: dict | None = None  # AdamW moments between turns (host memory)
        self.master_weights: list[torch.Tensor] | None = None  # fp32 master of a bf16 agent between turns (host)
        self.master_shards: list[torch.Tensor] | None = None  # under torchrun: this rank's shards of it
        self._prompt_cache: dict = {}  # (messages, thinking) -> prompt ids; the tokenizer never changes
        self._text_cache: dict = {}  # text -> ids
        self.before_training: list = []  # callables run once, before this agent first gets an optimizer
        self.freeze()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def grad_parameters(self) -> list[torch.Tensor]:
        """The tensors holding this agent's gradients (for clipping): a bf16 agent's fp32 masters, else its own."""
        if isinstance(self.optimizer, MasterWeightAdamW):
            return self.optimizer.master
        return own_parameters(self.model)

    def freeze(self, offload_optimizer: bool = False) -> None:
        """No gradients, no optimizer on the accelerator; ``offload_optimizer`` keeps the moments on the host."""
        if offload_optimizer and self.optimizer is not None:
            self.saved_optimizer_state = _to_cpu(self.optimizer.state_dict())
        if isinstance(self.optimizer, MasterWeightAdamW):
            self.master_weights = self.optimizer.release()  # fp32 master to the host, hooks removed
        self.model.zero_grad(set_to_none=True)  # a frozen agent holds no gradient buffers
        self.model.eval()
        self.model.requires_grad_(False)
        self.optimizer = None

    def start_training(self, lr: float, weight_decay: float = 0.0, extra_params=None) -> torch.optim.Optimizer:
        """Give this agent gradients and an AdamW (its offloaded moments if it has them); the others
        stay frozen. ``extra_params`` (e.g. a value head) form a second group (``param_groups``). First runs and
        drops the ``before_training`` callables (a responder sharing these weights takes its own copy)."""
        hooks, self.before_training = self.before_training, []
        for hook in hooks:
            hook()
        params = own_parameters(self.model)  # the whole model, or its adapter (a shared base stays frozen)
        for p in params:
            p.requires_grad_(True)
        self.model.train()
        extra = list(extra_params) if extra_params is not None else []
        if params[0].dtype == torch.float32:
            self.optimizer = torch.optim.AdamW(param_groups(params, extra, lr), lr=lr, weight_decay=weight_decay,
                                               betas=ADAMW_BETAS)
        else:  # bf16 / fp16 weights: fp32 master weights, fp32 gradients and fp32 moments
            self.optimizer = MasterWeightAdamW(params, self.master_weights, extra, lr=lr, weight_decay=weight_decay)
            self.master_weights = None
        saved, self.saved_optimizer_state = self.saved_optimizer_state, None
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if saved is not None and len(saved["param_groups"]) != len(lrs):
            warnings.warn(f"agent '{self.spec.name}': saved AdamW state has {len(saved['param_groups'])} parameter "
                          f"groups, this update has {len(lrs)} (value head added or removed); "
                          "starting from fresh moments")
        elif saved is not None:
            self.optimizer.load_state_dict(saved)  # moves the moments to the parameters' device
            for group, group_lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = group_lr
        return self.optimizer

    def render_prompt(self, messages: list[dict], enable_thinking: bool = False) -> str:
        """The agent's own chat template; Qwen3's thinking switch is passed through (others ignore it)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=enable_thinking)

    def encode_prompt(self, messages: list[dict], enable_thinking: bool = False) -> list[int]:
        """Token ids of the rendered chat prompt, cached: the same problems come back every stage and evaluation."""
        key = (tuple((m["role"], m["content"]) for m in messages), enable_thinking)
        return self._encode(self._prompt_cache, key, lambda: self.render_prompt(messages, enable_thinking))

    def continuation_ids(self, content: str, ended_with_eos: bool, enable_thinking: bool = False) -> list[int]:
        """Token ids that follow one of this agent's turns in its chat: the close of its turn (less the eos it
        sampled), a user turn holding ``content`` and the opening of its next turn, as its chat template writes
        them after an assistant message. A template that rewrites earlier turns cannot continue a sampled
        sequence; it is refused."""
        marker = "\x00SAT_TURN\x00"
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        before = self.tokenizer.apply_chat_template(chat, tokenize=False)
        after = self.tokenizer.apply_chat_template(chat + [{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=enable_thinking)
        if not after.startswith(before):
            raise ValueError(f"agent '{self.spec.name}': its chat template rewrites earlier turns when a turn is "
                             "added, so an episode's sampled tokens cannot be continued; use a model whose template "
                             "only appends")
        close = before[before.rindex(marker) + len(marker):]
        eos = self.tokenizer.eos_token
        if ended_with_eos and close.startswith(eos):
            close = close[len(eos):]
        return self.tokenizer(close + after[len(before):], add_special_tokens=False)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens), cached like prompts."""
        return self._encode(self._text_cache, text, lambda: text)

    def _encode(self, cache: dict, key, render) -> list[int]:
        """Token ids of ``render()`` through a bounded cache (dicts keep insertion order: the oldest half
        goes when full); a copy, since callers may extend it."""
        if key not in cache:
            if len(cache) >= ENCODE_CACHE_SIZE:
                for old in list(cache)[: ENCODE_CACHE_SIZE // 2]:
                    del cache[old]
            cache[key] = self.tokenizer(render(), add_special_tokens=False)["input_ids"]
        return list(cache[key])


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on fp32 master weights of a low-precision (bf16) model.

    At the paper's lr 1e-5 an AdamW step moves a weight by about 1e-5, less than half a bf16 rounding
    step for any |w| > 2.6e-3, so stepping bf16 parameters directly rounds most updates away. Forward
    and backward run on the bf16 weights, so the trained agent, its frozen reference pi_j,cur and the
    behaviour log-probs are ONE function (log r = 0 before the first step; fp32 weights under bf16
    autocast would not be). Each bf16 gradient is added into an fp32 gradient on the master as backward
    produces it, AdamW steps the master with fp32 moments, the master is rounded into the bf16 weights.

    Between turns the master waits on the host (``release``), so sub-bf16-step updates accumulate across
    stages; an element whose bf16 weight no longer equals round(master) (a backtracked or rejected step,
    weights loaded anew) restarts from its bf16 value. Bytes per trained parameter: 2 + 4 + 4 + 8."""

    def __init__(self, params: list[torch.Tensor], master: list[torch.Tensor] | None, extra: list[torch.Tensor],
                 lr: float, weight_decay: float = 0.0):
        self.model_params = params
        with torch.no_grad():
            if master is None or len(master) != len(params) or any(m.shape != p.shape for m, p in zip(master, params)):
                master = [p.detach().float() for p in params]
            else:  # keep the fp32 residual only where the bf16 weight is still round(master)
                master = [torch.where(m.to(p.device, p.dtype) == p, m.to(p.device), p.float())
                          for m, p in zip(master, params)]
        self.master = [m.detach().clone().requires_grad_(True) for m in master]
        super().__init__(param_groups(self.master, extra, lr), lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS)
        self._hooks = [p.register_post_accumulate_grad_hook(self._to_master(m)) for p, m in zip(params, self.master)]

    @staticmethod
    def _to_master(m: torch.Tensor):
        def hook(p: torch.Tensor) -> None:  # bf16 grad -> fp32 grad on the master; free the bf16 buffer
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad.float())
            p.grad = None
        return hook

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.master):
            p.copy_(m)  # round to nearest into the bf16 weights the forward uses
        return loss

    def release(self) -> list[torch.Tensor]:
        """Remove the gradient hooks; return the master weights on the host."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return [m.detach().to("cpu", copy=True) if m.is_cuda else m.detach() for m in self.master]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):  # a DTensor (FSDP2 under torchrun) keeps this rank's shard
        return (obj.to_local() if hasattr(obj, "to_local") else obj).detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def check_same_vocabulary(incumbent: Agent, replacement: Agent) -> None:
    """Stage-0 mixes per-token distributions: both agents must share the tokenizer map and the LM head's width."""
    v_inc, v_new = incumbent.tokenizer.get_vocab(), replacement.tokenizer.get_vocab()
    w_inc = incumbent.model.get_output_embeddings().weight.shape[0]
    w_new = replacement.model.get_output_embeddings().weight.shape[0]
    if v_inc != v_new or w_inc != w_new:
        raise ValueError(f"cannot project '{replacement.spec.name}' onto '{incumbent.spec.name}' per token: their "
                         f"vocabularies differ ({incumbent.spec.name}: {len(v_inc)} tokens, LM head {w_inc}; "
                         f"{replacement.spec.name}: {len(v_new)} tokens, LM head {w_new}); choose a replacement "
                         "that shares the incumbent's tokenizer")


@dataclass
class TeamConfig:
    """The task's part of a team (its reward, how it reads an answer, its vote) and how agents are prompted."""

    reward: Reward  # the team reward R and its range (reward.py)
    extract: Callable[[str, str], str | None]  # (response, instruction) -> the agent's answer, or None
    vote: Callable[[list[str | None]], str | None]  # the agents' answers -> the independent protocol's team answer
    protocol: str = "independent"  # independent | chain
    enable_thinking: bool = False  # Qwen3's thinking switch, passed to every chat template
    instruction: str = ""  # appended to every problem, e.g. "put your final answer within \\boxed{}"
    roles: object | None = None  # harness.roles.Roles: a system turn and user template per agent (None: the paper's)
    environment: object | None = None  # harness.environments.Environment: rounds of act, observe, act again
    responder: object | None = None  # an Agent the environment asks questions (Environment.ask): frozen, never trained
    responder_max_tokens: int = 64  # the most new tokens of one responder reply


class Team:
    """Ordered agents + a protocol; agent k's prompt is built with its own tokenizer and chat template."""

    def __init__(self, agents: list[Agent], config: TeamConfig):
        self.agents = agents
        self.config = config
        if self.config.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol '{self.config.protocol}': choose one of {', '.join(PROTOCOLS)}")
        if not agents:
            raise ValueError("a team needs at least one agent")

    def __len__(self) -> int:
        return len(self.agents)

    @property
    def protocol(self) -> str:
        return self.config.protocol

    @property
    def procs(self) -> OneProcess:
        """The processes the team runs on (every agent's)."""
        return self.agents[0].procs

    @property
    def sees_whole_turns(self) -> bool:
        """Whether a later agent of the chain reads the earlier agents' whole responses of its round rather than
        their extracted answers: with an environment, whose ``step`` acts on every response of the round on one
        world, so an agent that saw only "Agent 1: ?" could not know what had been done."""
        return self.config.environment is not None

    def user_message(self, problem: Problem, previous_answers: list[str | None],
                     previous_texts: list[str] | None = None) -> str:
        """The text agent k reads without roles; chain: with the earlier agents' extracted answers (a thinking
        model's whole response can be 30k tokens), or, with an environment (``sees_whole_turns``), their whole
        responses, written as the later rounds write them (``round_text``)."""
        text = problem.problem + self.config.instruction
        if self.config.protocol != "chain" or not previous_answers:
            return text
        if self.sees_whole_turns:
            return text + "\n\n" + self.turn_lines(list(enumerate(previous_texts or [])))
        lines = "\n".join(f"Agent {i + 1}: {a if a is not None else '?'}" for i, a in enumerate(previous_answers))
        return f"{text}\n{lines}\n"

    def messages(self, k: int, problem: Problem, previous_answers: list[str | None],
                 previous_texts: list[str] | None = None) -> list[dict]:
        """Agent k's chat messages: its role's system turn and user template (--roles; with an environment its
        {previous} holds whole responses), else the problem's own system turn, if any, and ``user_message``.
        ``previous_*``: the earlier agents' turns (chain)."""
        if self.config.roles is not None:
            return self.config.roles.messages(k, problem, previous_texts or [], previous_answers,
                                              "full" if self.sees_whole_turns else None)
        system = [{"role": "system", "content": problem.system}] if problem.system else []
        return system + [{"role": "user", "content": self.user_message(problem, previous_answers, previous_texts)}]

    def prompt_ids(self, agent_index: int, problem: Problem, previous_answers: list[str | None],
                   previous_texts: list[str] | None = None) -> list[int]:
        messages = self.messages(agent_index, problem, previous_answers, previous_texts)
        return self.agents[agent_index].encode_prompt(messages, self.config.enable_thinking)

    def round_text(self, k: int, entries: list[tuple[int, str]], round_: int) -> str:
        """Agent k's user turn in a later round (``round_``: 2, 3, ...): what the other agents said ("Agent i: ..."),
        then the environment's answer (speaker -1, as written), in the order they came; through its role's
        ``next`` template when --roles gives one."""
        turns = self.turn_lines(entries)
        return turns if self.config.roles is None else self.config.roles.round_message(k, turns, round_)

    @staticmethod
    def turn_lines(entries: list[tuple[int, str]]) -> str:
        """(speaker, text) entries as an agent reads them: "Agent i: ..." for agent i - 1, an environment's
        observation (speaker -1) as written, blank lines between."""
        return "\n\n".join(text if speaker < 0 else f"Agent {speaker + 1}: {text}" for speaker, text in entries)

    def team_answer(self, answers: list[str | None]) -> str | None:
        """The task's vote (independent) or the last agent's answer (chain)."""
        if self.config.protocol == "independent":
            return self.config.vote(answers)
        return answers[-1]

    def swap(self, slot: int, new_agent: Agent, projected: bool = True) -> Agent:
        """Plug-and-play: put ``new_agent`` in ``slot`` (0-based); returns the incumbent. ``projected``: it went
        through Stage-0, whose per-token mixture needs the incumbent's vocabulary (a raw swap does not)."""
        if not 0 <= slot < len(self.agents):
            raise ValueError(f"--upgrade slot {slot + 1} is out of range: the team has agents 1..{len(self.agents)}")
        if projected:
            check_same_vocabulary(self.agents[slot], new_agent)
        incumbent, self.agents[slot] = self.agents[slot], new_agent
        return incumbent

    def extract(self, text: str) -> str | None:
        """An agent's answer as the task reads it from its response to this team's instruction."""
        return self.config.extract(text, self.config.instruction)
