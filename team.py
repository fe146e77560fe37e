"""The team: agents (one causal LM each) and the factorized team policy.

Paper, Section 3: a team of n agents is one factorized policy pi(a|s) = prod_i pi_i(a_i|s); each
agent's action is a whole response. Protocols: ``independent`` (every agent answers alone; the team
answer is the majority vote, ties -> earliest agent) and ``chain`` (agent k also sees the extracted
answers of agents 1..k-1; the last agent's answer is the team answer). Agent specs: ``parse_agents``.

A bf16 agent trains on fp32 master weights (``MasterWeightAdamW``). A tiny agent is a real
``Qwen3ForCausalLM`` with a real (character-level) tokenizer and chat template: it goes through
exactly the same code as a downloaded checkpoint.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from advantage import masked_mean
from config import PROTOCOLS, AgentSpec, parse_agents, resolve_agent_spec  # noqa: F401  parse_agents: team's API
from grading import extract_answer, majority_vote
from logprobs import left_pad, response_hidden_states, right_pad, token_logprobs_from_hidden
from processes import ONE_PROCESS, OneProcess
from tasks import Problem, noisy_label

# The tiny character tokenizer's specials; its chat template uses the role markers as a real chat model does.
TINY_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|unk|>"]
TINY_CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ENCODE_CACHE_SIZE = 1 << 16  # entries per agent and cache


def build_char_tokenizer():
    """A character-level tokenizer built offline, wrapped like a hub tokenizer: BPE with an empty
    merge list splits text into characters; the role markers are added tokens (atomic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.decoder = decoders.Fuse()  # join characters without spaces
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        unk_token="<|unk|>", padding_side="left")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, layers: int = 4, seed: int = 0, hidden: int = 128):
    """A randomly initialised Qwen3ForCausalLM small enough for two CPU cores."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=2048,  # AIME prompts fit
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # same seed -> bit-identical weights
        return Qwen3ForCausalLM(config)


class Agent:
    """One team member: a causal LM, its tokenizer, and (only while it is the agent being trained)
    an optimizer. Frozen agents hold no gradients and no optimizer state: SAT's memory advantage."""

    def __init__(self, spec: AgentSpec, model, tokenizer, procs: OneProcess = ONE_PROCESS):
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.procs = procs  # the processes its computation is spread over (processes.py: the scale-out seam)
        self.optimizer: torch.optim.Optimizer | None = None
        self.saved_optimizer_state: dict | None = None  # AdamW moments between turns (host memory)
        self.master_weights: list[torch.Tensor] | None = None  # fp32 master of a bf16 agent between turns (host)
        self.master_shards: list[torch.Tensor] | None = None  # under torchrun: this rank's shards of it
        self._prompt_cache: dict = {}  # (messages, thinking) -> prompt ids; the tokenizer never changes
        self._text_cache: dict = {}  # text -> ids
        self.freeze()

    @classmethod
    def load(cls, spec: AgentSpec | str, device: str = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> "Agent":
        """The agent of ``spec``, whole on ``device`` (straight into FSDP2 shards under torchrun:
        ``scale.shard_load.load_agent_sharded``). A tiny agent is built from ``seed``."""
        spec = folder_spec(resolve_agent_spec(spec) if isinstance(spec, str) else spec)
        if spec.kind == "tiny":
            tokenizer = build_char_tokenizer()
            model = build_tiny_model(tokenizer, layers=spec.tiny_layers, seed=seed)
        else:
            model, tokenizer = _load_pretrained(spec.source, dtype)
        model.to(device=device, dtype=dtype)
        return cls(spec, model, prepare_tokenizer(tokenizer, spec.name, spec.source))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        meta = {"name": self.spec.name, "kind": self.spec.kind, "source": self.spec.source}
        (path / "agent.json").write_text(json.dumps(meta))

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "Agent":
        """Load an agent saved by ``save``: a local source under its original name."""
        path = Path(path)
        meta = json.loads((path / "agent.json").read_text()) if (path / "agent.json").exists() else {"name": str(path)}
        return cls.load(AgentSpec(name=meta["name"], kind="local", source=str(path)), device, dtype)

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
        return list(self.model.parameters())

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
        stay frozen. ``extra_params`` (e.g. a value head) form a second group at 10x the learning rate."""
        self.model.requires_grad_(True)
        self.model.train()
        params = list(self.model.parameters())
        extra = list(extra_params) if extra_params is not None else []
        if params[0].dtype == torch.float32:
            groups = [{"params": params, "lr": lr}] + ([{"params": extra, "lr": 10 * lr}] if extra else [])
            self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
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
        groups = [{"params": self.master, "lr": lr}] + ([{"params": extra, "lr": 10 * lr}] if extra else [])
        super().__init__(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
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


def prepare_tokenizer(tokenizer, name: str, source: str):
    """Every agent's tokenizer, wherever it was loaded from (``Agent.load``, ``scale.shard_load``): its own
    chat template (a base model without one is refused, not guessed at), a pad token (the EOS where the
    checkpoint ships none: padding is masked out everywhere) and left padding (prompts end where generation
    starts)."""
    if not getattr(tokenizer, "chat_template", None):
        where = f"{source}/tokenizer_config.json" if os.path.isdir(source) else f"a local copy of {source}"
        raise ValueError(f"agent '{name}' ({source}): its tokenizer has no chat template, so its prompts cannot be "
                         f"built; use a chat/instruct checkpoint, or add a \"chat_template\" to {where}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def hub_offline() -> bool:
    """Whether the Hugging Face hub is out of reach: HF_HUB_OFFLINE is set, or one TCP connection to
    the endpoint fails within 3 s (probed once per process and endpoint), so an offline run fails in
    seconds. Behind a proxy a direct connection says nothing: the hub counts as reachable."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    return not _reachable(host)


@functools.lru_cache(maxsize=None)
def _reachable(host: str) -> bool:
    """One TCP connection to ``host``:443 within 3 s; cached, so a run probes each endpoint once."""
    import socket

    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def check_hub_available(spec: AgentSpec) -> None:
    """Before any work: a hub model that is neither cached nor reachable, or a GGUF file not converted yet without
    the packages that convert it, is one clear line."""
    if spec.kind == "gguf" and not gguf_cache_folder(spec.source).is_dir():
        check_gguf_packages()
    if spec.kind != "hub":
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(spec.source, "config.json"), str) and hub_offline():
        raise RuntimeError(f"model '{spec.source}' is not in the local cache and the hub cannot be reached (offline); "
                           f"download it where there is network (huggingface-cli download {spec.source}) or pass a "
                           "local checkpoint folder")


def _load_pretrained(source: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local_only = os.path.isdir(source) or hub_offline()  # offline: no retries, the cache or a clear error
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    except OSError as err:  # not cached and no network, or a wrong id
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(f"could not load model '{source}' ({first}); download it first "
                           f"(huggingface-cli download {source}) or pass a local checkpoint folder") from err
    return model, tokenizer


def folder_spec(spec: AgentSpec) -> AgentSpec:
    """A GGUF spec as the local spec of its converted folder (``gguf_to_folder``; the name kept), so the agent
    loads, checkpoints and starts vLLM engines as any local checkpoint; any other spec as it is."""
    if spec.kind != "gguf":
        return spec
    return AgentSpec(name=spec.name, kind="local", source=str(gguf_to_folder(spec.source)))


def gguf_cache_folder(path: str | Path) -> Path:
    """Where ``gguf_to_folder`` keeps the conversion of ``path``: ``$SAT_CACHE/gguf`` (default
    ``~/.cache/sat/gguf``), one folder per file version (stem, size, mtime), so a changed file is converted anew."""
    path = Path(path)
    stat = path.stat()
    root = Path(os.environ.get("SAT_CACHE") or Path.home() / ".cache" / "sat")
    return root / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def check_gguf_packages() -> None:
    """One line naming the install when the packages that read a GGUF file are missing."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"reading a GGUF model file needs the package(s) {', '.join(missing)}: "
                           "pip install gguf accelerate")


def gguf_to_folder(path: str | Path) -> Path:
    """The GGUF file ``path`` as an ordinary Hugging Face folder (config, fp32 safetensors, tokenizer with its chat
    template), converted on first use and cached (``gguf_cache_folder``). Why: checkpoints, vLLM engines, the
    sharded loader and eval_aime.py all read a folder, and the dequantisation (~25 s for SmolLM2-135M) is paid once.

    Transformers refuses ``save_pretrained`` on a GGUF-loaded model (and under torchrun writes weights on rank 0
    only), so the weights are written here: each parameter once (a tied head under its embedding's name, as
    ``save_pretrained`` does), the config without its GGUF ``quantization_config`` (else the folder would load as a
    GGUF model again). Written into a temporary folder next to the cache and renamed into place, so a folder that
    exists is complete; processes converting at once all end with the same folder."""
    folder = gguf_cache_folder(path)
    if folder.is_dir():
        return folder
    check_gguf_packages()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it (vLLM reads it)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        os.chmod(tmp, 0o755)  # an ordinary folder, not mkdtemp's private one
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, folder)
    except OSError:
        if not folder.is_dir():  # not another process's conversion that got there first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@dataclass
class TeamConfig:
    protocol: str = "independent"  # independent | chain
    enable_thinking: bool = False  # Qwen3's thinking switch, passed to every chat template
    instruction: str = ""  # appended to every problem, e.g. "put your final answer within \\boxed{}"


class Team:
    """Ordered agents + a protocol; agent k's prompt is built with its own tokenizer and chat template."""

    def __init__(self, agents: list[Agent], config: TeamConfig | None = None):
        self.agents = agents
        self.config = config or TeamConfig()
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

    def user_message(self, problem: Problem, previous_answers: list[str | None]) -> str:
        """The text agent k reads; chain: with the earlier agents' extracted answers (a thinking model's
        whole response can be 30k tokens)."""
        text = problem.problem + self.config.instruction
        if self.config.protocol == "chain" and previous_answers:
            lines = "\n".join(f"Agent {i + 1}: {a if a is not None else '?'}" for i, a in enumerate(previous_answers))
            text = f"{text}\n{lines}\n"
        return text

    def prompt_ids(self, agent_index: int, problem: Problem, previous_answers: list[str | None]) -> list[int]:
        agent = self.agents[agent_index]
        messages = [{"role": "user", "content": self.user_message(problem, previous_answers)}]
        return agent.encode_prompt(messages, self.config.enable_thinking)

    def team_answer(self, answers: list[str | None]) -> str | None:
        """Majority vote (independent) or the last agent's answer (chain)."""
        if self.config.protocol == "independent":
            return majority_vote(answers)
        return answers[-1]

    def swap(self, slot: int, new_agent: Agent) -> Agent:
        """Plug-and-play: put ``new_agent`` in ``slot`` (0-based, same vocabulary); returns the incumbent."""
        if not 0 <= slot < len(self.agents):
            raise ValueError(f"--upgrade slot {slot + 1} is out of range: the team has agents 1..{len(self.agents)}")
        check_same_vocabulary(self.agents[slot], new_agent)
        incumbent, self.agents[slot] = self.agents[slot], new_agent
        return incumbent

    def extract(self, text: str) -> str | None:
        """An agent's answer; asked for a \\boxed{} answer, only a complete final one counts (not a truncated one)."""
        return extract_answer(text, final_only="\\boxed" in self.config.instruction)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        for k, agent in enumerate(self.agents):
            agent.save(path / f"agent_{k}")
        self.save_meta(path)

    def save_meta(self, path: str | Path) -> None:
        """team.json: the protocol, the instruction and the agents' names (``save`` writes the agents too)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"protocol": self.config.protocol, "enable_thinking": self.config.enable_thinking,
                "instruction": self.config.instruction, "agents": [a.spec.name for a in self.agents]}
        (path / "team.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "Team":
        """A team saved by ``save``, each agent whole (sharded: ``read_team``'s folders)."""
        folders, cfg = read_team(path)
        return cls([Agent.from_checkpoint(f, device, dtype) for f in folders], cfg)


def read_team(path: str | Path) -> tuple[list[Path], TeamConfig]:
    """(the agents' checkpoint folders in slot order, the team's config) of a folder written by ``Team.save``."""
    path = Path(path)
    meta = json.loads((path / "team.json").read_text())
    cfg = TeamConfig(meta["protocol"], meta["enable_thinking"], meta["instruction"])
    return [path / f"agent_{k}" for k in range(len(meta["agents"]))], cfg


def warm_start(team: Team, problems: list[Problem], steps: int, p_wrong: float, seed: int, lr: float = 1e-3,
               batch: int = 64, slots: list[int] | None = None) -> None:
    """A short supervised phase standing in for pretraining: teach tiny agents the answer format on labels
    wrong with probability ``p_wrong`` (off by 1, 2 or 10), so they start weak but not at zero reward (a
    sparse exact-match reward gives no gradient at zero accuracy). Each agent sees its real prompt format
    (chain: noisy earlier answers). One stream from ``seed`` draws agent 1's batches, then agent 2's, ..."""
    from tqdm import tqdm

    rng = random.Random(seed)
    for k, agent in enumerate(team.agents):
        if agent.spec.kind != "tiny" or (slots is not None and k not in slots):
            continue
        tok = agent.tokenizer
        opt = agent.start_training(lr)
        for _ in tqdm(range(steps), desc=f"warm start agent {k + 1} (stands in for pretraining)", leave=False,
                      disable=None):  # a bar only on a terminal: a log file gets no carriage-return updates
            items = [rng.choice(problems) for _ in range(batch)]
            contexts = [team.prompt_ids(k, p, [noisy_label(p.answer, rng, p_wrong) for _ in range(k)]) for p in items]
            targets = [agent.encode_text(noisy_label(p.answer, rng, p_wrong)) + [tok.eos_token_id] for p in items]
            ctx, cmask = left_pad(contexts, tok.pad_token_id)  # [b, Lc]
            resp, rmask = right_pad(targets, tok.pad_token_id)  # [b, Lr]
            hidden = response_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [b, Lr, H]
            loss = -masked_mean(token_logprobs_from_hidden(agent.model, hidden, resp, 1.0), rmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        agent.freeze()
