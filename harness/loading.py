"""Loading and saving agents and teams: tiny agents built offline, Hugging Face checkpoints (hub or local),
GGUF files converted once into a cached folder, the team's folder in a checkpoint, and the warm start that
stands in for pretraining. The paper's modules receive the ``team.Agent``s built here and never load
anything themselves.

A tiny agent is a real ``Qwen3ForCausalLM`` with a real (character-level) tokenizer and chat template: it
goes through exactly the same code as a downloaded checkpoint.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from adapter import Adapter, LoraSettings
from harness import lora
from harness.config import resolve_agent_spec
from harness.math_grading import math_team_config
from harness.roles import parse_roles
from harness.tasks import noisy_label
from logprobs import left_pad, masked_mean, response_hidden_states, right_pad, token_logprobs_from_hidden
from team import Agent, AgentSpec, Problem, Team, TeamConfig

# The tiny character tokenizer's specials; its chat template uses the role markers as a real chat model does.
TINY_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|unk|>"]


TINY_CHARS = ["\n"] + [chr(c) for c in range(32, 127)]


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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


def prepare_tokenizer(tokenizer, name: str, source: str):
    """Every agent's tokenizer, wherever it was loaded from (``load_agent``, ``scale.shard_load``): its own
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


def read_team(path: str | Path) -> tuple[list[Path], TeamConfig]:
    """(the agents' checkpoint folders in slot order, the team's config) of a folder written by ``save_team``."""
    path = Path(path)
    meta = json.loads((path / "team.json").read_text())
    n_agents = len(meta["agents"])
    roles = parse_roles(meta["roles"], str(path / "team.json"), n_agents, meta["protocol"]) if meta.get("roles") \
        else None  # the same prompts on --resume and in eval_aime.py
    cfg = math_team_config(meta["protocol"], meta["enable_thinking"], meta["instruction"], roles)
    return [path / f"agent_{k}" for k in range(n_agents)], cfg


def warm_start(team: Team, problems: list[Problem], steps: int, p_wrong: float, seed: int, lr: float = 1e-3,
               batch: int = 64, slots: list[int] | None = None) -> None:
    """A short supervised phase standing in for pretraining: teach tiny agents the answer format on labels
    wrong with probability ``p_wrong`` (off by 1, 2 or 10), so they start weak but not at zero reward (a
    sparse exact-match reward gives no gradient at zero accuracy). Each agent sees its real prompt format
    (chain: noisy earlier answers). One stream from ``seed`` draws agent 1's batches, then agent 2's, ..."""
    from tqdm import tqdm

    rng = random.Random(seed)
    others = [p.answer for p in problems[:256]]  # wrong labels for answers that are not whole numbers
    for k, agent in enumerate(team.agents):
        if agent.spec.kind != "tiny" or (slots is not None and k not in slots):
            continue
        tok = agent.tokenizer
        opt = agent.start_training(lr)
        for _ in tqdm(range(steps), desc=f"warm start agent {k + 1} (stands in for pretraining)", leave=False,
                      disable=None):  # a bar only on a terminal: a log file gets no carriage-return updates
            items = [rng.choice(problems) for _ in range(batch)]
            earlier = [[noisy_label(p.answer, rng, p_wrong, others) for _ in range(k)] for p in items]
            contexts = [team.prompt_ids(k, p, labels, labels) for p, labels in zip(items, earlier)]
            targets = [agent.encode_text(noisy_label(p.answer, rng, p_wrong, others)) + [tok.eos_token_id]
                       for p in items]
            ctx, cmask = (t.to(agent.device) for t in left_pad(contexts, tok.pad_token_id))  # [b, Lc]
            resp, rmask = (t.to(agent.device) for t in right_pad(targets, tok.pad_token_id))  # [b, Lr]
            hidden = response_hidden_states(agent.model, ctx, cmask, resp, rmask)  # [b, Lr, H]
            loss = -masked_mean(token_logprobs_from_hidden(agent.model, hidden, resp, 1.0), rmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        agent.freeze()


# The seeds of a run's tiny weights, from its --seed s: slot k (0-based) gets s * AGENT_SEED_STRIDE + k, the
# responder the slot after the team's last, an --upgrade's replacement for slot k the slot REPLACEMENT_SLOT_OFFSET + k
# (clear of any team's slots), and that replacement's warm start draws its labels under s + UPGRADE_WARM_START_OFFSET.
AGENT_SEED_STRIDE = 100
REPLACEMENT_SLOT_OFFSET = 50
UPGRADE_WARM_START_OFFSET = 7


def agent_seed(run_seed: int, slot: int) -> int:
    """The seed of the tiny weights in ``slot`` of a run seeded ``run_seed`` (``sat.py`` and eval_aime.py alike)."""
    return run_seed * AGENT_SEED_STRIDE + slot


def replacement_seed(run_seed: int, slot: int) -> int:
    """The seed of an --upgrade's tiny replacement for ``slot``."""
    return agent_seed(run_seed, REPLACEMENT_SLOT_OFFSET + slot)


def load_agent(spec: AgentSpec | str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Agent:
    """The agent of ``spec``, whole on ``device`` (straight into FSDP2 shards under torchrun:
    ``scale.shard_load.load_agent_sharded``). A tiny agent is built from ``seed``."""
    spec = folder_spec(resolve_agent_spec(spec) if isinstance(spec, str) else spec)
    if spec.kind == "tiny":
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, layers=spec.tiny_layers, seed=seed)
    else:
        model, tokenizer = _load_pretrained(spec.source, dtype)
    model.to(device=device, dtype=dtype)
    return Agent(spec, model, prepare_tokenizer(tokenizer, spec.name, spec.source))


def load_agents(specs: list[AgentSpec], device: str, dtype: torch.dtype, seeds: list[int],
                settings: LoraSettings | None = None, load=None) -> list[Agent]:
    """One agent per spec (``load(spec, device, dtype, seed=...)``: ``load_agent`` or the processes' own). With
    ``settings`` (--lora) each is a base plus its own adapter, and specs that name one base share one copy of it
    (``lora.base_key``; a tiny base is built from the first such slot's seed)."""
    load = load or load_agent
    if settings is None:
        return [load(spec, device, dtype, seed=seed) for spec, seed in zip(specs, seeds)]
    bases: dict[tuple, tuple[Agent, int]] = {}
    agents = []
    for spec, seed in zip(specs, seeds):
        if lora.base_key(spec) not in bases:
            bases[lora.base_key(spec)] = (load(spec, device, dtype, seed=seed), seed)
        base, base_seed = bases[lora.base_key(spec)]
        agents.append(lora.with_adapter(base, Adapter(settings, base_seed), seed))
    return agents


def save_agent(agent: Agent, path: str | Path) -> None:
    """The agent as a Hugging Face folder (what vLLM engines and eval_aime.py load) and its name in agent.json; an
    adapter agent (--lora) as its adapter only (``lora.save_adapter``)."""
    if agent.adapter is not None:
        return lora.save_adapter(agent, path)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    agent.model.save_pretrained(path)
    agent.tokenizer.save_pretrained(path)
    meta = {"name": agent.spec.name, "kind": agent.spec.kind, "source": agent.spec.source}
    (path / "agent.json").write_text(json.dumps(meta))


def load_saved_agent(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Agent:
    """An agent saved by ``save_agent``: a local source under its original name."""
    path = Path(path)
    meta = json.loads((path / "agent.json").read_text()) if (path / "agent.json").exists() else {"name": str(path)}
    return load_agent(AgentSpec(name=meta["name"], kind="local", source=str(path)), device, dtype)


def saved_adapter(path: str | Path) -> tuple[AgentSpec, Adapter] | None:
    """(base spec, adapter) of a folder ``save_agent`` wrote for an adapter agent; None for a whole model's."""
    meta_file = Path(path) / "agent.json"
    return lora.adapter_of(json.loads(meta_file.read_text())) if meta_file.exists() else None


def load_saved_agents(folders: list[Path], device: str, dtype: torch.dtype, load=None) -> list[Agent]:
    """The agents ``save_agent`` wrote in ``folders`` (``load``: ``load_saved_agent`` or the processes' own); the
    adapters among them (--lora) on their bases, one copy of each base (``lora.base_key``)."""
    load = load or load_saved_agent
    bases: dict[tuple, Agent] = {}
    agents = []
    for folder in folders:
        saved = saved_adapter(folder)
        if saved is None:
            agents.append(load(folder, device, dtype))
            continue
        spec, adapter = saved
        key = lora.saved_base_key(spec, adapter)
        if key not in bases:  # a base the run trained: from the team folder, else from its spec
            trained = Path(folder).parent / lora.base_folder_name(adapter)
            bases[key] = load_agent(AgentSpec(spec.name, "local", str(trained)) if adapter.base_trained else spec,
                                    device, dtype, seed=adapter.base_seed)
        agent = lora.with_adapter(bases[key], adapter, adapter.base_seed, spec)
        lora.load_adapter_weights(agent, folder)
        agents.append(agent)
    return agents


def save_team(team: Team, path: str | Path) -> None:
    """Every agent's folder (``save_agent``) and team.json (``save_team_meta``)."""
    path = Path(path)
    for k, agent in enumerate(team.agents):
        save_agent(agent, path / f"agent_{k}")
    save_team_meta(team, path)


def save_team_meta(team: Team, path: str | Path) -> None:
    """team.json: the protocol, the instruction, the roles and the agents' names (``save_team`` writes the agents
    too). The reward is the run's (config.json): a function cannot be written to JSON."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"protocol": team.config.protocol, "enable_thinking": team.config.enable_thinking,
            "instruction": team.config.instruction, "agents": [a.spec.name for a in team.agents],
            "roles": team.config.roles.to_dict() if team.config.roles is not None else None}
    env = team.config.environment
    if env is not None:  # the spec eval_aime.py --ckpt plays the team in again
        meta["environment"] = {"spec": env.name, "max_rounds": env.max_rounds}
    (path / "team.json").write_text(json.dumps(meta))


def load_saved_team(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Team:
    """A team saved by ``save_team``, each agent whole (sharded: ``read_team``'s folders)."""
    folders, cfg = read_team(path)
    return Team(load_saved_agents(folders, device, dtype), cfg)
