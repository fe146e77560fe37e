"""PlanBench's blocksworld (Valmeekam et al., github.com/karthikv792/LLMs-Planning, MIT licence): its STRIPS domain,
its problem files and its natural-language form, for ``env:blocksworld``.

- The domain is ``plan-bench/instances/blocksworld/generated_domain.pddl`` (``blocksworld-4ops``): four actions whose
  preconditions, add and delete lists ``ACTIONS`` restates fact for fact. A state is the set of its ground facts;
  an action applies when every precondition is in the state, and then the state loses its delete list and gains
  its add list (deletes first, as PDDL orders them). A plan is valid, as PlanBench's validator (VAL) judges it, when
  each action applies in turn and the goal's facts are all in the final state (the hand need not be empty: the
  goal names only what it names).
- A problem file is a STRIPS ``(define (problem ...))`` with ``:objects``, ``:init`` and ``:goal``; ``parse_problem``
  reads exactly that.
- The words: PlanBench's ``configs/blocksworld.yaml`` (the domain description quoted in ``DOMAIN_INTRO``; objects a, b,
  c ... named red, blue, orange ... block; facts written "the red block is clear", "the hand is empty", "the red block
  is on top of the blue block", "the red block is on the table"), and its action phrases ("pick up the red block",
  "unstack the red block from on top of the blue block", ...).

``data/planbench_blocksworld.jsonl`` ships the parsed ``generated_basic`` instances (see data/README.md).
"""
from __future__ import annotations

import json
import re
from collections import deque
from functools import lru_cache
from pathlib import Path

Fact = tuple[str, ...]  # ("on", "a", "b"), ("handempty",): a ground atom of the domain

# PlanBench's configs/blocksworld.yaml, domain_intro (MIT, (c) 2024 Valmeekam Karthik), quoted as data.
DOMAIN_INTRO = (
    "I am playing with a set of blocks where I need to arrange the blocks into stacks. Here are the actions I can "
    "do\n\nPick up a block\nUnstack a block from on top of another block\nPut down a block\nStack a block on top of "
    "another block\n\nI have the following restrictions on my actions:\nI can only pick up or unstack one block at a "
    "time.\nI can only pick up or unstack a block if my hand is empty.\nI can only pick up a block if the block is on "
    "the table and the block is clear. A block is clear if the block has no other blocks on top of it and if the "
    "block is not picked up.\nI can only unstack a block from on top of another block if the block I am unstacking "
    "was really on top of the other block.\nI can only unstack a block from on top of another block if the block I "
    "am unstacking is clear.\nOnce I pick up or unstack a block, I am holding the block.\nI can only put down a block "
    "that I am holding.\nI can only stack a block on top of another block if I am holding the block being stacked.\n"
    "I can only stack a block on top of another block if the block onto which I am stacking the block is clear.\n"
    "Once I put down or stack a block, my hand becomes empty.\nOnce you stack a block on top of a second block, the "
    "second block is no longer clear."
)
# PlanBench's encoded_objects: PDDL object -> its colour (the block's name in every sentence).
COLOURS = {"a": "red", "b": "blue", "c": "orange", "d": "yellow", "e": "white", "f": "magenta", "g": "black",
           "h": "cyan", "i": "green", "j": "violet", "k": "silver", "l": "gold"}

# generated_domain.pddl, action by action: (parameters, preconditions, add list, delete list).
ACTIONS: dict[str, tuple[tuple[str, ...], tuple[Fact, ...], tuple[Fact, ...], tuple[Fact, ...]]] = {
    "pick-up": (("ob",), (("clear", "ob"), ("ontable", "ob"), ("handempty",)),
                (("holding", "ob"),), (("clear", "ob"), ("ontable", "ob"), ("handempty",))),
    "put-down": (("ob",), (("holding", "ob"),),
                 (("clear", "ob"), ("handempty",), ("ontable", "ob")), (("holding", "ob"),)),
    "stack": (("ob", "underob"), (("clear", "underob"), ("holding", "ob")),
              (("handempty",), ("clear", "ob"), ("on", "ob", "underob")), (("clear", "underob"), ("holding", "ob"))),
    "unstack": (("ob", "underob"), (("on", "ob", "underob"), ("clear", "ob"), ("handempty",)),
                (("holding", "ob"), ("clear", "underob")), (("on", "ob", "underob"), ("clear", "ob"), ("handempty",))),
}
PHRASES = {"pick-up": "pick up the {} block", "put-down": "put down the {} block",
           "stack": "stack the {} block on top of the {} block",
           "unstack": "unstack the {} block from on top of the {} block"}
MAX_BLOCKS = 6  # the shortest-plan search (the progress credit) may visit every state: ~7k of them at 6 blocks


def ground(atoms, binding: dict[str, str]) -> frozenset:
    """The facts of ``atoms`` with their parameters replaced by objects."""
    return frozenset((a[0], *(binding[p] for p in a[1:])) for a in atoms)


@lru_cache(maxsize=4096)
def grounded(action: str, args: tuple[str, ...]) -> tuple[frozenset, frozenset, frozenset]:
    """(preconditions, add list, delete list) of ``action(args)`` (a pure function, cached for the plan search)."""
    params, pre, add, delete = ACTIONS[action]
    binding = dict(zip(params, args))
    return ground(pre, binding), ground(add, binding), ground(delete, binding)


def apply(state: frozenset, action: str, args: tuple[str, ...]) -> frozenset | Fact:
    """The state after ``action(args)``, or the first precondition (a ground fact) that does not hold."""
    pre, add, delete = grounded(action, tuple(args))
    if not pre <= state:
        return min(pre - state)
    return (state - delete) | add


def ground_actions(objects: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Every ground action over ``objects`` (parameters may coincide, as the domain does not forbid it)."""
    return [(name, (x,)) for name in ("pick-up", "put-down") for x in objects] + [
        (name, (x, y)) for name in ("stack", "unstack") for x in objects for y in objects]


def applicable(state: frozenset, objects: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The ground actions whose preconditions could hold, read off the state's facts (a superset of the applicable
    ones in any state of this domain; ``apply`` still checks each)."""
    held = [f[1] for f in state if f[0] == "holding"]
    clear = [f[1] for f in state if f[0] == "clear"]
    if held:
        return [("put-down", (held[0],))] + [("stack", (held[0], y)) for y in clear]
    return [("pick-up", (x,)) for x in clear] + [("unstack", (f[1], f[2])) for f in state if f[0] == "on"]


def successors(state: frozenset, objects: list[str]) -> list[frozenset]:
    """Every state one applicable action leads to."""
    out = (apply(state, name, args) for name, args in applicable(state, objects))
    return [s for s in out if isinstance(s, frozenset)]


def forward_plan_length(state: frozenset, goal: frozenset, objects: list[str]) -> int:
    """The fewest actions that make every goal fact hold, breadth-first from ``state``."""
    seen, frontier = {state}, deque([(state, 0)])
    while frontier:
        current, depth = frontier.popleft()
        if goal <= current:
            return depth
        for nxt in successors(current, objects):
            if nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, depth + 1))
    raise ValueError("the goal cannot be reached from this state")


@lru_cache(maxsize=8)
def state_graph(objects: tuple[str, ...]) -> tuple[dict[frozenset, int], list[list[int]]]:
    """Every well-formed state over ``objects`` (those reachable from all blocks on the table: all of them) and
    their neighbours. Each action has an inverse (pick-up / put-down, unstack / stack), so the graph is undirected."""
    start = frozenset({("handempty",)} | {(p, o) for o in objects for p in ("ontable", "clear")})
    index, order, frontier = {start: 0}, [start], deque([start])
    while frontier:
        for nxt in successors(frontier.popleft(), list(objects)):
            if nxt not in index:
                index[nxt] = len(order)
                order.append(nxt)
                frontier.append(nxt)
    return index, [[index[n] for n in successors(s, list(objects))] for s in order]


@lru_cache(maxsize=256)
def goal_distances(objects: tuple[str, ...], goal: frozenset) -> list[int]:
    """The fewest actions from each state of ``state_graph`` to one where the goal holds (breadth-first from all of
    those at once, over the undirected graph); -1 where none is reachable."""
    index, neighbours = state_graph(objects)
    dist = [-1] * len(neighbours)
    frontier = deque()
    for state, i in index.items():
        if goal <= state:
            dist[i] = 0
            frontier.append(i)
    while frontier:
        i = frontier.popleft()
        for j in neighbours[i]:
            if dist[j] < 0:
                dist[j] = dist[i] + 1
                frontier.append(j)
    return dist


def plan_length(state: frozenset, goal: frozenset, objects: list[str]) -> int:
    """The fewest actions that make every goal fact hold: read off ``goal_distances`` for a well-formed state, else
    searched forward from it (a problem file's initial state may be one the graph does not hold)."""
    if len(objects) > MAX_BLOCKS:
        raise ValueError(f"{len(objects)} blocks; the shortest-plan search plays at most {MAX_BLOCKS}")
    key = tuple(sorted(objects))
    i = state_graph(key)[0].get(state)
    if i is None:
        return forward_plan_length(state, goal, objects)
    d = goal_distances(key, goal)[i]
    if d < 0:
        raise ValueError("the goal cannot be reached from this state")
    return d


# -- Problem files ---------------------------------------------------------------------------------------------
def sexp(text: str):
    """The nested lists of a PDDL text (comments after ';' dropped, names lower-cased)."""
    tokens = re.findall(r"[()]|[^\s()]+", re.sub(r";[^\n]*", "", text).lower())
    stack: list[list] = [[]]
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) == 1:
                raise ValueError("unbalanced ')'")
            done = stack.pop()
            stack[-1].append(done)
        else:
            stack[-1].append(tok)
    if len(stack) != 1 or len(stack[0]) != 1:
        raise ValueError("unbalanced '(' or more than one form")
    return stack[0][0]


def facts_of(form) -> list[Fact]:
    """The atoms of an ``(and ...)`` or of a single atom."""
    if form and form[0] == "and":
        return [tuple(a) for a in form[1:]]
    return [tuple(form)]


def parse_problem(text: str) -> dict:
    """{"objects": [...], "init": [fact, ...], "goal": [fact, ...]} of a PlanBench blocksworld problem file."""
    form = sexp(text)
    if not (isinstance(form, list) and form[:1] == ["define"]):
        raise ValueError("not a (define (problem ...)) form")
    parts = {p[0]: p[1:] for p in form[2:] if isinstance(p, list) and p}
    missing = [k for k in (":objects", ":init", ":goal") if k not in parts]
    if missing:
        raise ValueError(f"no {missing[0]} section")
    objects = [o for o in parts[":objects"] if o != "-" and o != "object"]
    init, goal = [tuple(a) for a in parts[":init"]], facts_of(parts[":goal"][0])
    known = set(objects)
    for fact in init + goal:
        arity = {"clear": 1, "ontable": 1, "handempty": 0, "holding": 1, "on": 2}.get(fact[0])
        if arity is None or len(fact) != arity + 1 or not set(fact[1:]) <= known:
            raise ValueError(f"({' '.join(fact)}) is not a fact of blocksworld-4ops over {' '.join(objects)}")
    unnamed = [o for o in objects if o not in COLOURS]
    if unnamed:
        raise ValueError(f"object {unnamed[0]!r} has no colour; PlanBench's objects are a to l")
    return {"objects": objects, "init": [list(f) for f in init], "goal": [list(f) for f in goal]}


def read_folder(folder: str) -> list[dict]:
    """Every ``*.pddl`` problem of a folder (the domain file skipped), parsed, with its file name as ``instance``."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"--task-option instances={folder}: no such folder; give a folder of PDDL problem files "
                         "or 'planbench' (the shipped generated_basic instances)")
    rows = []
    for f in sorted(path.glob("*.pddl"), key=natural_key):
        text = f.read_text()
        if re.search(r"\(\s*define\s*\(\s*domain", text, re.I):
            continue
        try:
            rows.append({"instance": f.stem, **parse_problem(text)})
        except ValueError as e:
            raise ValueError(f"--task-option instances={folder}: {f.name}: {e}") from None
    if not rows:
        raise ValueError(f"--task-option instances={folder}: no PDDL problem files (*.pddl) in it")
    return rows


def natural_key(path: Path):
    """instance-2 before instance-10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


SHIPPED = Path(__file__).resolve().parents[1] / "data" / "planbench_blocksworld.jsonl"


def shipped_instances() -> list[dict]:
    """The generated_basic instances shipped in data/ (one JSON object a line)."""
    return [json.loads(line) for line in SHIPPED.read_text().splitlines() if line.strip()]


# -- Words --------------------------------------------------------------------------------------------------------
def fact_text(fact: Fact) -> str:
    """One fact in PlanBench's words."""
    name = [f"the {COLOURS[o]} block" for o in fact[1:]]
    return {"clear": "{} is clear", "ontable": "{} is on the table", "handempty": "the hand is empty",
            "holding": "the hand is currently holding {}", "on": "{} is on top of {}"}[fact[0]].format(*name)


ORDER = ("clear", "handempty", "holding", "on", "ontable")


def facts_text(facts) -> str:
    """Facts in PlanBench's order (clear, hand, on, on the table; objects alphabetical), joined "a, b and c"."""
    words = [fact_text(f) for f in sorted(facts, key=lambda f: (ORDER.index(f[0]), f[1:]))]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


ACTION_TEXT = re.compile(r"\b(pick up|put down|unstack|stack) the (\w+) block"
                         r"(?: (?:on top of|from on top of|onto|on) the (\w+) block)?", re.I)
VERBS = {"pick up": "pick-up", "put down": "put-down", "stack": "stack", "unstack": "unstack"}


def actions_in(text: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(action, colour arguments, the words) of every action a response names, in order; a two-block verb without
    its second block keeps one argument (and is refused when applied)."""
    out = []
    for m in ACTION_TEXT.finditer(text):
        verb, x, y = VERBS[m.group(1).lower()], m.group(2).lower(), m.group(3) and m.group(3).lower()
        out.append((verb, (x,) if verb in ("pick-up", "put-down") or y is None else (x, y), m.group(0)))
    return out
