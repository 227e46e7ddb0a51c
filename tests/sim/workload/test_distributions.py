import math

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from sim.workload.distributions import (
    ArrivalProcess,
    BurstArrivals,
    EmpiricalLength,
    FixedLatency,
    FixedLength,
    GammaArrivals,
    LatencyDist,
    LengthDist,
    LogNormalLatency,
    LogNormalLength,
    PoissonArrivals,
    PriorityClass,
    UniformLength,
    check_priority_classes,
    sample_priority_classes,
)

N = 20_000


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_fixed_and_uniform_lengths():
    assert FixedLength(value=7).sample(rng(), 3).tolist() == [7, 7, 7]
    draws = UniformLength(low=3, high=5).sample(rng(), N)
    assert set(draws.tolist()) == {3, 4, 5}


def test_uniform_rejects_low_above_high_quoting_both():
    with pytest.raises(ValidationError, match="low=9 > high=3"):
        UniformLength(low=9, high=3)


def test_lognormal_length_median_and_clipping():
    draws = LogNormalLength(median=500, sigma=1.0, min=50, max=4000).sample(rng(), N)
    assert draws.dtype == np.int64
    assert draws.min() == 50 and draws.max() == 4000
    assert 470 <= np.median(draws) <= 530
    with pytest.raises(ValidationError, match="min=10 > max=5"):
        LogNormalLength(median=7, sigma=1, min=10, max=5)


@pytest.mark.parametrize(
    "dist",
    [
        LogNormalLength(median=150, sigma=0.6, min=16, max=1000),
        LogNormalLength(median=3, sigma=4.0),  # clipped at both ends
        LogNormalLength(median=200, sigma=0.0),
        FixedLength(value=7),
        UniformLength(low=3, high=90),
        EmpiricalLength(values=[10, 20, 30]),
    ],
)
def test_sample_one_draws_what_sample_of_one_draws(dist):
    one, batch = rng(7), rng(7)
    draws = [dist.sample_one(one) for _ in range(5_000)]
    assert all(type(d) is int for d in draws)
    assert draws == [int(dist.sample(batch, 1)[0]) for _ in range(5_000)]
    assert one.random() == batch.random()  # the two streams stay in step


def test_lognormal_length_never_below_one():
    assert LogNormalLength(median=1, sigma=3).sample(rng(), N).min() >= 1


def test_empirical_values_resample_only_observed():
    draws = EmpiricalLength(values=[10, 20, 30]).sample(rng(), N)
    assert set(draws.tolist()) == {10, 20, 30}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "exactly one of values or path"),
        ({"values": [1], "path": "x.txt"}, "exactly one of values or path"),
        ({"values": []}, "values is empty"),
        ({"values": [5, 0]}, r"values must be between 1 and 2,097,152, got \[0\]"),
        ({"values": [5], "column": "n"}, "column='n' needs a path"),
    ],
)
def test_empirical_rejects_bad_sources(args, message):
    with pytest.raises(ValidationError, match=message):
        EmpiricalLength(**args)


def test_empirical_reads_lines_lazily(tmp_path):
    path = tmp_path / "lengths.txt"
    dist = EmpiricalLength(path=str(path))  # parsing does no I/O: the file need not exist yet
    path.write_text("# output lengths\n12\n\n34\n")
    assert set(dist.sample(rng(), 200).tolist()) == {12, 34}


def test_empirical_reads_csv_column(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("prompt,output\n100,7\n200,9\n")
    assert set(EmpiricalLength(path=str(path), column="output").sample(rng(), 200)) == {7, 9}
    with pytest.raises(ValueError, match=r"2 columns \['prompt', 'output'\]; set column"):
        EmpiricalLength(path=str(path)).sample(rng(), 1)
    with pytest.raises(ValueError, match="no column 'x'"):
        EmpiricalLength(path=str(path), column="x").sample(rng(), 1)


def test_empirical_refuses_an_empty_csv_cell_and_a_column_of_a_plain_list(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("prompt,output\n100,7\n200,\n")
    with pytest.raises(ValueError, match=r"lengths.csv:3: column 'output' is empty"):
        EmpiricalLength(path=str(path), column="output").sample(rng(), 1)
    plain = tmp_path / "lengths.txt"
    plain.write_text("12\n\n13\n")  # blank lines in a plain list are skipped
    assert set(EmpiricalLength(path=str(plain)).sample(rng(), 100)) == {12, 13}
    with pytest.raises(ValueError, match=r"column='output' is for a .csv file"):
        EmpiricalLength(path=str(plain), column="output").sample(rng(), 1)


def test_empirical_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("12\nabc\n")
    message = r"lengths.txt:2: length 'abc' is not an integer between 1 and 2,097,152"
    with pytest.raises(ValueError, match=message):
        EmpiricalLength(path=str(path)).sample(rng(), 1)


def test_poisson_mean_rate_within_statistical_bound():
    times = PoissonArrivals(rate_per_s=4.0).arrival_times(rng(), N)
    assert np.all(np.diff(times) >= 0)
    # Mean gap 0.25 s, std of the sample mean 0.25/sqrt(N): 5 sigma is ~0.009 s.
    assert abs(times[-1] / N - 0.25) < 5 * 0.25 / math.sqrt(N)


def test_gamma_arrivals_rate_and_burstiness():
    gaps = np.diff(GammaArrivals(rate_per_s=2.0, cv=3.0).arrival_times(rng(), N))
    assert abs(gaps.mean() - 0.5) < 0.05
    assert 2.5 < gaps.std() / gaps.mean() < 3.5


def test_burst_arrivals_all_at_once():
    assert BurstArrivals(at_s=2.5).arrival_times(rng(), 3).tolist() == [2.5, 2.5, 2.5]


def test_lognormal_latency_hits_median_and_p95():
    latency = LogNormalLatency(median_s=1.5, p95_s=20.0)
    assert latency.sigma == pytest.approx(math.log(20 / 1.5) / 1.645, rel=1e-3)
    draws = latency.sample(rng(), N)
    assert np.median(draws) == pytest.approx(1.5, rel=0.05)
    assert np.quantile(draws, 0.95) == pytest.approx(20.0, rel=0.1)


def test_lognormal_latency_rejects_p95_below_median():
    with pytest.raises(ValidationError, match=r"p95_s=1\.0 is below median_s=1\.5"):
        LogNormalLatency(median_s=1.5, p95_s=1.0)


def test_fixed_latency():
    assert FixedLatency(value_s=0.5).sample(rng(), 2).tolist() == [0.5, 0.5]


def test_discriminated_unions_parse_from_yaml_shapes():
    assert TypeAdapter(LengthDist).validate_python({"kind": "uniform", "low": 1, "high": 2}) == (
        UniformLength(low=1, high=2)
    )
    arrival = TypeAdapter(ArrivalProcess).validate_python(
        {"kind": "gamma", "rate_per_s": 1, "cv": 2}
    )
    assert isinstance(arrival, GammaArrivals)
    latency = TypeAdapter(LatencyDist).validate_python({"kind": "fixed", "value_s": 1})
    assert latency == FixedLatency(value_s=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TypeAdapter(LengthDist).validate_python({"kind": "fixed", "value": 1, "mean": 2})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        TypeAdapter(LengthDist).validate_python({"kind": "zipf"})


def test_priority_classes_mix_follows_weights():
    classes = [PriorityClass(name="interactive", weight=1), PriorityClass(name="batch", weight=3)]
    ids = sample_priority_classes(rng(), classes, N)
    assert abs(np.mean(ids == 1) - 0.75) < 0.02
    with pytest.raises(ValueError, match=r"duplicate names \['a'\]"):
        check_priority_classes([PriorityClass(name="a"), PriorityClass(name="a")])
    with pytest.raises(ValueError, match="priority_classes is empty"):
        check_priority_classes([])
