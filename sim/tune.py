"""The tuner: Optuna searches vLLM's engine knobs for the best config under SLOs.

Each trial is one engine config (block size, ``gpu_memory_utilization``, token budget,
``max_num_seqs``, long-prefill threshold, prefix caching, scheduling policy and, for the
cost objective, tensor parallelism) applied to the scenario. A config vLLM refuses or
whose model does not fit is not simulated (Optuna is told the trial failed). Objectives:

- ``goodput``: requests per second that meet every SLO, at the scenario's load;
- ``cost-per-million-tokens``: GPU-hours (times ``gpu_hour_usd``) per million output
  tokens at the scenario's load, lower is better (a fleet's GPUs are its replicas times
  the tensor-parallel degree: its throughput is the whole fleet's);
- ``max-sessions``: the capacity (:mod:`sim.capacity`) of the config: the heaviest load it
  holds; one trial costs a whole capacity search.

With ``memory_policies`` the search also picks a memory policy per trial
(:data:`MEMORY_POLICIES`): vLLM's own engine, a CPU offload tier (vLLM 0.32's
``--kv-offloading-size``) of a searched size, and, unless only exportable configs are
wanted, the what-ifs vLLM 0.32 lacks (swap preemption, KV retention during tool waits). A
size the hardware's host memory cannot hold is refused like any other invalid config.

Trial 0 is the scenario's own engine config (its value of every searched knob, added to the
search space where the space lacks it; with ``memory_policies``, its memory policy and size
when it is one the search offers, else vLLM's own engine, and the trial says so): the search
starts from what the user runs today, and its result is never worse than that when that
config is feasible. TPE then samples at random until a third of the budget has run (trial 0
included, at most Optuna's default of 10: a budget of 15 leaves 10 guided trials instead of
5) and from its model of the good trials after that.

A trial is feasible when every request finished and every SLO held (for ``max-sessions``:
when some load held); Optuna's TPE sampler gets that as its constraint, so it learns where
the feasible region is. The report carries every trial, the best feasible config and the
Pareto front of the feasible trials over output throughput (higher), p99 TTFT and p99 ITL
(lower). The sampler is seeded: the same scenario and seed give the same trials.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from sim.capacity import default_knob, find_capacity
from sim.config.sizing import size_deployable_kv_cache
from sim.errors import KvsimConfigError
from sim.scenario import Scenario, check_runnable, parse_scenario

Objective = Literal["goodput", "cost-per-million-tokens", "max-sessions"]
OBJECTIVES: tuple[str, ...] = ("goodput", "cost-per-million-tokens", "max-sessions")

# The search space: engine field -> the values tried (every one is a value vLLM accepts).
SPACE: dict[str, tuple[Any, ...]] = {
    "block_size": (16, 32, 64),
    "max_num_batched_tokens": (2048, 4096, 8192, 16384),
    "max_num_seqs": (64, 128, 256, 512),
    "long_prefill_token_threshold": (0, 1024, 4096),
    "enable_prefix_caching": (True, False),
    "scheduling_policy": ("fcfs", "priority"),
    "tensor_parallel_size": (1, 2, 4, 8),
}
GPU_MEMORY_UTILIZATION = (0.80, 0.95)

# Memory policies the tuner may pick, as engine fields; "offload" and "swap" take a size
# in GiB from the lists after them. The first two are configs vLLM 0.32 runs (exportable).
MEMORY_POLICIES: dict[str, dict[str, Any]] = {
    "vllm": {},
    "offload": {"kv_offload_gib": None},
    "swap": {"preemption_mode": "swap", "swap_space_gib": None},
    "retention": {"kv_retention": {"policy": "tool_latency"}},
}
EXPORTABLE_POLICIES = ("vllm", "offload")
# What a picked policy starts from: vLLM's own engine (the scenario's policy is replaced).
POLICY_RESET: dict[str, Any] = {
    "preemption_mode": "recompute",
    "swap_space_gib": None,
    "kv_offload_gib": None,
    "kv_retention": {"policy": "none"},
}
OFFLOAD_GIB = (32, 64, 128, 192)
SWAP_SPACE_GIB = (16, 64)


@dataclass
class Trial:
    number: int
    params: dict[str, Any]  # engine field -> value
    state: str  # "ok", "infeasible" (ran, missed an SLO), "invalid" (not simulated)
    objective: float | None
    # The memory policy picked (MEMORY_POLICIES), None when policies are not searched.
    policy: str | None = None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    simulations: int = 0
    # Trial 0: what it is (the scenario's own config, or its knobs on vLLM's own engine).
    baseline: str | None = None


@dataclass
class TuneResult:
    objective: str
    direction: str
    trials: list[Trial]
    best: Trial | None
    pareto: list[Trial]

    @property
    def simulations(self) -> int:
        return sum(t.simulations for t in self.trials)


def _metrics(summary: dict[str, Any]) -> dict[str, Any]:
    m = summary["metrics"]
    return {
        "goodput_req_s": m.get("goodput_req_s"),
        "output_throughput_tok_s": m.get("output_throughput_tok_s"),
        "ttft_p99_s": (m.get("vllm:time_to_first_token_seconds") or {}).get("p99"),
        "itl_p99_s": (m.get("vllm:inter_token_latency_seconds") or {}).get("p99"),
        "e2e_p99_s": (m.get("vllm:e2e_request_latency_seconds") or {}).get("p99"),
        "preemptions": (m.get("vllm:num_preemptions") or {}).get("total"),
        "slo_pass": all(v["pass"] for v in summary["slos"].values()),
        # Requests not finished, or (a cut open-loop or trace run) not yet arrived.
        "unfinished": summary["num_requests"]
        - summary["num_finished"]
        + summary.get("num_not_arrived", 0),
    }


def pareto_front(trials: list[Trial]) -> list[Trial]:
    """The feasible trials no other feasible trial beats on throughput (higher), p99 TTFT
    and p99 ITL (lower) at once, by throughput."""

    names = ("output_throughput_tok_s", "ttft_p99_s", "itl_p99_s")

    def key(t: Trial) -> tuple[float, float, float]:
        m = t.metrics
        return (-m["output_throughput_tok_s"], m["ttft_p99_s"], m["itl_p99_s"])

    feasible = [
        t for t in trials if t.state == "ok" and all(t.metrics.get(n) is not None for n in names)
    ]
    front = [
        t for t in feasible
        if not any(all(a <= b for a, b in zip(key(o), key(t), strict=True)) and key(o) != key(t)
                   for o in feasible)
    ]  # fmt: skip
    return sorted(front, key=key)


def tune(
    scenario: Scenario,
    objective: str,
    budget: int,
    simulate_summary: Callable[[Scenario], dict[str, Any]],
    gpu_hour_usd: float = 1.0,
    seed: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    memory_policies: str | None = None,
    deployable: bool = False,
) -> TuneResult:
    """Run ``budget`` Optuna trials (invalid configs included) and report them.

    ``memory_policies``: None searches vLLM's engine knobs only; "exportable" also the
    CPU offload tier; "all" also the what-ifs vLLM 0.32 lacks (swap, retention).
    ``deployable`` (the best config will be exported): a trial vLLM could not start on the
    GPU (a pinned block count its block size or memory share cannot hold) is invalid."""
    import optuna

    if objective not in OBJECTIVES:
        raise KvsimConfigError(
            f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}"
        )
    if budget < 1:
        raise KvsimConfigError(f"--budget {budget}: must be at least 1")
    if not scenario.slos.model_dump(exclude_none=True):
        raise KvsimConfigError(
            f"scenario {scenario.name!r}: no SLO to tune for; give one, e.g. --slo ttft_p99_s=2"
        )
    if objective == "max-sessions":
        default_knob(scenario)  # a workload with no load knob is refused before any trial
    if memory_policies not in (None, "exportable", "all"):
        raise KvsimConfigError(f"--memory-policies {memory_policies!r}: expected exportable or all")
    minimize = objective == "cost-per-million-tokens"
    space = dict(SPACE)
    if objective != "cost-per-million-tokens":  # more GPUs always win the other two
        space["tensor_parallel_size"] = (scenario.engine.tensor_parallel_size,)
    baseline = baseline_params(scenario, memory_policies)
    space = {name: _with(values, baseline[name]) for name, values in space.items()}
    sizes = {
        "kv_offload_gib": _with(OFFLOAD_GIB, baseline.get("kv_offload_gib")),
        "swap_space_gib": _with(SWAP_SPACE_GIB, baseline.get("swap_space_gib")),
    }
    # Steps of 0.01 over a range that holds the scenario's own value (trial 0 runs that value
    # as it is, also between two steps).
    util = baseline["gpu_memory_utilization"]
    hundredths = round(util * 100, 6)
    util_low = min(GPU_MEMORY_UTILIZATION[0], math.floor(hundredths) / 100)
    util_high = max(GPU_MEMORY_UTILIZATION[1], math.ceil(hundredths) / 100)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(
        seed=scenario.seed if seed is None else seed, n_startup_trials=startup_trials(budget)
    )
    study = optuna.create_study(direction="minimize" if minimize else "maximize", sampler=sampler)
    study.enqueue_trial(baseline)
    base = scenario.model_dump(mode="json")
    trials: list[Trial] = []
    for _ in range(budget):
        ask = study.ask()
        params: dict[str, Any] = {
            name: ask.suggest_categorical(name, list(values)) for name, values in space.items()
        }
        with warnings.catch_warnings():  # trial 0's value may lie between two steps
            warnings.simplefilter("ignore")
            value = ask.suggest_float("gpu_memory_utilization", util_low, util_high, step=0.01)
        params["gpu_memory_utilization"] = value if ask.number == 0 else round(value, 2)
        policy = None
        if memory_policies is not None:
            policy, fields = _suggest_memory_policy(ask, memory_policies, sizes)
            params |= fields
        trial = Trial(ask.number, params, "invalid", None, policy=policy)
        if ask.number == 0:
            trial.baseline = baseline_note(scenario, memory_policies)
        document = {**base, "engine": trial_engine(base["engine"], trial)}
        try:
            spec = parse_scenario(document, f"{scenario.name} trial {ask.number}")
            check_runnable(spec)
            if deployable:
                size_deployable_kv_cache(spec.model, spec.hardware, spec.engine)
        except KvsimConfigError as exc:
            trial.error = str(exc)
            study.tell(ask, state=optuna.trial.TrialState.FAIL)
        else:
            value, feasible = _evaluate(spec, objective, trial, simulate_summary, gpu_hour_usd)
            trial.state = "ok" if feasible else "infeasible"
            trial.objective = value
            ask.set_constraint("slos", 0.0 if feasible else 1.0)  # > 0: infeasible
            study.tell(ask, value)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    ok = [t for t in trials if t.state == "ok" and t.objective is not None]
    # The best objective; on a tie, the earliest trial.
    sign = 1.0 if minimize else -1.0
    best = min(ok, key=lambda t: (sign * t.objective, t.number)) if ok else None
    direction = "minimize" if minimize else "maximize"
    return TuneResult(objective, direction, trials, best, pareto_front(trials))


def startup_trials(budget: int) -> int:
    """How many trials TPE samples at random before it models the good ones: a third of the
    budget, at least 1 and at most Optuna's default of 10 (with 10 random trials of 15, the
    search would be mostly random)."""
    return min(10, max(1, budget // 3))


def baseline_params(scenario: Scenario, memory_policies: str | None = None) -> dict[str, Any]:
    """The scenario's own value of every searched knob: the first trial, as Optuna
    parameters (with ``memory_policies``, its policy and size when the search offers that
    policy, else vLLM's own engine)."""
    engine = scenario.engine
    params: dict[str, Any] = {name: getattr(engine, name) for name in SPACE}
    params["gpu_memory_utilization"] = engine.gpu_memory_utilization
    if memory_policies is not None:
        policy = scenario_policy(scenario, memory_policies) or ("vllm", {})
        params["memory_policy"] = policy[0]
        params |= policy[1]
    return params


def scenario_policy(scenario: Scenario, which: str) -> tuple[str, dict[str, Any]] | None:
    """The memory policy (:data:`MEMORY_POLICIES`) the scenario runs and its size, when the
    search over ``which`` offers it; None otherwise (another what-if, or one of them set up
    in a way no trial would be)."""
    engine = scenario.engine
    names = EXPORTABLE_POLICIES if which == "exportable" else tuple(MEMORY_POLICIES)
    swap = engine.preemption_mode == "swap"
    offload = engine.kv_offload_gib
    retention = engine.kv_retention.model_dump(mode="json")
    plain_retention = retention == type(engine.kv_retention)().model_dump(mode="json")
    if not swap and offload is None and plain_retention:
        return "vllm", {}
    if not swap and offload is not None and plain_retention:
        return "offload", {"kv_offload_gib": offload}
    if swap and offload is None and plain_retention and "swap" in names:
        return "swap", {"swap_space_gib": engine.swap_space_gib}
    tool_latency = type(engine.kv_retention)(**MEMORY_POLICIES["retention"]["kv_retention"])
    if (
        not swap
        and offload is None
        and "retention" in names
        and retention == tool_latency.model_dump(mode="json")
    ):
        return "retention", {}
    return None


def baseline_note(scenario: Scenario, memory_policies: str | None) -> str:
    """What trial 0 is."""
    if memory_policies is None or scenario_policy(scenario, memory_policies) is not None:
        return "the scenario's own config"
    return "the scenario's engine knobs, on vLLM's own engine (its memory policy is not searched)"


def _with(values: tuple[Any, ...], value: Any) -> tuple[Any, ...]:
    """A knob's choices, with the scenario's own value added (in order) when they lack it."""
    if value is None or value in values:
        return values
    return tuple(sorted((*values, value)))


def _suggest_memory_policy(
    ask: Any, which: str, sizes: dict[str, tuple[Any, ...]]
) -> tuple[str, dict[str, Any]]:
    """The memory policy an Optuna trial picks and its engine fields (a size, from
    ``sizes``, only for the policy that has one: a conditional parameter)."""
    names = list(EXPORTABLE_POLICIES if which == "exportable" else MEMORY_POLICIES)
    policy = ask.suggest_categorical("memory_policy", names)
    fields = dict(MEMORY_POLICIES[policy])
    size = {"offload": "kv_offload_gib", "swap": "swap_space_gib"}.get(policy)
    if size is not None:
        fields[size] = ask.suggest_categorical(size, list(sizes[size]))
    return policy, fields


def trial_engine(base_engine: dict[str, Any], trial: Trial) -> dict[str, Any]:
    """The engine section a trial runs: the scenario's, with the trial's knobs, and, when
    it picked a memory policy, that policy in place of the scenario's."""
    reset = POLICY_RESET if trial.policy is not None else {}
    return {**base_engine, **reset, **trial.params}


def overrides(base_engine: dict[str, Any], trial: Trial) -> list[str]:
    """The trial as ``--set`` overrides of the scenario (a policy reset only where the
    scenario set another policy)."""
    engine = trial_engine(base_engine, trial)
    names = list(trial.params)
    if trial.policy is not None:
        retention = (base_engine.get("kv_retention") or {}).get("policy", "none")
        names += [
            name
            for name, unset in POLICY_RESET.items()
            if name not in trial.params
            and (retention != "none" if name == "kv_retention" else base_engine.get(name) != unset)
        ]
    return [f"engine.{name}={json.dumps(engine[name])}" for name in names]


def _evaluate(
    spec: Scenario,
    objective: str,
    trial: Trial,
    simulate_summary: Callable[[Scenario], dict[str, Any]],
    gpu_hour_usd: float,
) -> tuple[float, bool]:
    if objective == "max-sessions":
        counted: list[int] = []

        def counting(s: Scenario) -> dict[str, Any]:
            counted.append(1)
            return simulate_summary(s)

        try:
            result = find_capacity(spec, counting)
        except KvsimConfigError as exc:  # no load holds with this config
            trial.error = str(exc)
            trial.simulations = len(counted)
            return 0.0, False
        trial.simulations = len(counted)
        top = next(p for p in result.curve if p.load == result.capacity)
        trial.metrics = {
            "capacity": result.capacity,
            "capacity_unit": result.knob.unit,
            # Every load tried held, up to the knob's ceiling: the search's bound, not the
            # config's (trials there tie; more load or tighter SLOs would part them).
            "capacity_at_ceiling": result.first_failing is None,
            "output_throughput_tok_s": top.output_throughput_tok_s,
            "ttft_p99_s": top.ttft_p99_s,
            "itl_p99_s": top.itl_p99_s,
        }
        return float(result.capacity or 0.0), True
    summary = simulate_summary(spec)
    trial.simulations = 1
    trial.metrics = _metrics(summary)
    feasible = trial.metrics["slo_pass"] and trial.metrics["unfinished"] == 0
    if objective == "goodput":
        return float(trial.metrics["goodput_req_s"] or 0.0), feasible
    throughput = trial.metrics["output_throughput_tok_s"] or 0.0
    gpus = spec.engine.tensor_parallel_size * (spec.fleet.replicas if spec.fleet else 1)
    gpu_hours_per_million = gpus / (throughput * 3600) * 1e6 if throughput else 1e12
    trial.metrics["cost_per_million_tokens"] = gpu_hours_per_million * gpu_hour_usd
    return trial.metrics["cost_per_million_tokens"], feasible
