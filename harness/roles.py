"""``--roles FILE`` (YAML or JSON): a system turn and a user template per agent, rendered into chat messages.

The paper trains its teams "without role assignments" (the default: no file). Roles serve the role-play
baselines it compares against and teams such as planner, solver, critic and verifier. The file:

    previous: answers        # what {previous} holds: "answers" (default) or "full"
    agents:                  # one entry for every agent, or one per agent
      - system: You solve the problem step by step.
        user: "{problem}"
      - system: You check the solver's answer and give the final one.
        user: "{problem}\\n\\nThe solver answered:\\n{previous}"

(a bare list of entries is the ``agents`` list). ``{problem}`` is the problem text; ``{previous}``, in the chain
protocol only, the earlier agents' turns of the same joint trajectory, one "Agent i: ..." line each. By default it
holds their extracted answers, as the chain protocol without roles does (a thinking model's whole response can be
30k tokens); ``previous: full`` gives their whole responses. Write ``{{`` and ``}}`` for literal braces. An entry
without ``system`` keeps the row's own system turn (a chat prompt's), if it has one. With an environment
(``--env``), {previous} always holds the whole responses (the environment acts on them), and an entry's
optional ``next`` template is the agent's user turn in rounds 2, 3, ...: ``{turns}`` holds
what the other agents and the environment said since its last turn, ``{round}`` the round's number.
"""
from __future__ import annotations

import json
import os
import string
from dataclasses import asdict, dataclass
from pathlib import Path

PLACEHOLDERS = ("problem", "previous")
PREVIOUS_MODES = ("answers", "full")
FILE_NAME = "roles.json"  # the copy kept in the run folder: --resume and eval_aime.py rebuild the same prompts


@dataclass(frozen=True)
class Role:
    system: str | None
    user: str  # a template with {problem} and, in the chain protocol, {previous}
    next: str | None = None  # an environment's later rounds: the user turn, a template with {turns} and {round}


@dataclass(frozen=True)
class Roles:
    """One role for every agent, or one per agent; ``previous``: what {previous} holds (PREVIOUS_MODES)."""

    agents: tuple[Role, ...]
    previous: str = "answers"

    def role(self, k: int) -> Role:
        return self.agents[k if len(self.agents) > 1 else 0]

    def messages(self, k: int, problem, previous_texts: list[str], previous_answers: list[str | None],
                 previous: str | None = None) -> list[dict]:
        """Agent k's chat messages for ``problem`` (a tasks.Problem; its ``system``, if any, where the role
        has none), given the earlier agents' responses and extracted answers in the same trajectory;
        ``previous`` (a PREVIOUS_MODES entry) overrides the file's mode: an environment's chain shows whole
        responses."""
        role = self.role(k)
        system = role.system if role.system is not None else getattr(problem, "system", None)
        user = role.user.format(problem=problem.problem,
                                previous=previous_block(previous_texts, previous_answers, previous or self.previous))
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def round_message(self, k: int, turns: str, round_: int) -> str:
        """Agent k's user turn in round ``round_`` (2, 3, ...) of an episode: its ``next`` template with ``turns``
        (what the others and the environment said since its last turn), else ``turns`` itself."""
        template = self.role(k).next
        return turns if template is None else template.format(turns=turns, round=round_)

    def to_dict(self) -> dict:
        return {"previous": self.previous,
                "agents": [{k: v for k, v in asdict(r).items() if k != "next" or v is not None} for r in self.agents]}


def previous_block(texts: list[str], answers: list[str | None], mode: str) -> str:
    """What {previous} holds: "Agent i: <answer>" lines (? for none), or each earlier agent's whole response."""
    if mode == "answers":
        return "\n".join(f"Agent {i + 1}: {a if a is not None else '?'}" for i, a in enumerate(answers))
    return "\n\n".join(f"Agent {i + 1}:\n{t}" for i, t in enumerate(texts))


def template_fields(template: str, where: str) -> set[str]:
    """The placeholders of a user template, or one line for a malformed one or an unknown placeholder."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"{where}: the user template is not a valid template ({e}); write {{problem}} and "
                         "{previous} for the placeholders, {{ and }} for literal braces") from None
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"{where}: unknown placeholder {{{unknown[0]}}} in the user template; use {{problem}} and "
                         "(chain protocol) {previous}; write {{ and }} for literal braces")
    return fields


def parse_entry(entry, where: str) -> Role:
    """One agents entry ({system, user}) as a Role; one line for a wrong key or type."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with system and user, got {type(entry).__name__}")
    unknown = sorted(set(entry) - {"system", "user", "next"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; an entry has system, user and (with an environment) "
                         "next")
    system, user = entry.get("system"), entry.get("user")
    if not isinstance(user, str) or not user.strip():
        raise ValueError(f"{where}: user must be a template such as \"{{problem}}\", got {user!r}")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{where}: system must be text (or left out), got {type(system).__name__}")
    nxt = entry.get("next")
    if nxt is not None:
        if not isinstance(nxt, str):
            raise ValueError(f"{where}: next must be a template such as \"Round {{round}}:\\n{{turns}}\", got {nxt!r}")
        try:
            nxt.format(turns="", round=2)
        except (KeyError, ValueError, IndexError) as e:
            raise ValueError(f"{where}: the next template takes {{turns}} and {{round}} only ({e!r}); write {{{{ and "
                             "}} for literal braces") from None
    return Role(system, user, nxt)


def parse_roles(data, source: str, n_agents: int, protocol: str) -> Roles:
    """Roles from a file's parsed content, checked against the team: the number of entries (1 or n_agents),
    {problem} in every template, {previous} in the chain protocol only and there for every agent after the first."""
    if isinstance(data, list):
        data = {"agents": data}
    if not isinstance(data, dict) or not isinstance(data.get("agents"), list):
        raise ValueError(f"{source}: expected a list of entries, or a mapping with an agents list (and optionally "
                         "previous: answers|full)")
    unknown = sorted(set(data) - {"agents", "previous"})
    previous = data.get("previous", "answers")
    if unknown or previous not in PREVIOUS_MODES:
        bad = f"unknown key {unknown[0]!r}" if unknown else f"previous: {previous!r}"
        raise ValueError(f"{source}: {bad}; the file holds agents and previous ({' or '.join(PREVIOUS_MODES)})")
    entries = data["agents"]
    if len(entries) not in (1, n_agents):
        raise ValueError(f"{source} has {len(entries)} entries for a team of {n_agents} agents; give one entry for "
                         f"all agents or one per agent ({n_agents})")
    roles = Roles(tuple(parse_entry(e, f"{source}, agent {i + 1}") for i, e in enumerate(entries)), previous)
    for k in range(n_agents if len(entries) > 1 else 1):
        where = f"{source}, agent {k + 1}" if len(entries) > 1 else f"{source}, every agent"
        fields = template_fields(roles.role(k).user, where)
        if "problem" not in fields:
            raise ValueError(f"{where}: the user template has no {{problem}}, so the agent never sees the problem")
        if "previous" in fields and protocol != "chain":
            raise ValueError(f"{where}: {{previous}} needs --protocol chain (in the {protocol} protocol no agent "
                             "sees another's turn); drop it, or pass --protocol chain")
        if protocol == "chain" and "previous" not in fields and (k > 0 or len(entries) == 1) and n_agents > 1:
            raise ValueError(f"{where}: the chain protocol shows each agent the earlier agents' turns, but the user "
                             "template has no {previous}; add it")
    return roles


def load_roles(path: str | Path, n_agents: int, protocol: str) -> Roles:
    """Roles from a YAML (.yaml, .yml) or JSON (.json) file, checked by ``parse_roles``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--roles {path}: no such file; pass a YAML or JSON roles file")
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--roles {path}: expected a .yaml, .yml or .json file")
    text = path.read_text(encoding="utf-8")
    try:
        if suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--roles {path}: not valid {suffix[1:].upper()} ({type(e).__name__}: {first})") from None
    return parse_roles(data, str(path), n_agents, protocol)


def save_roles(roles: Roles, folder: str | Path) -> Path:
    """The roles as roles.json in a run folder, which ``load_roles`` reads back (the same prompts on resume)."""
    path = Path(folder) / FILE_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(roles.to_dict(), indent=1))
    os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one
    return path
