"""Each defense against a hand-computed case; seeds, batching, composition, the DP accountant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradleak.defenses import Stream, parse_defense
from gradleak.errors import ConfigError


def defend(spec: str, rows: list[list[float]], seed: int = 0) -> torch.Tensor:
    return parse_defense(spec, seed).gradients(torch.tensor(rows))


def test_quantisation_by_hand() -> None:
    # 2 bits: 4 levels between min 0 and max 3, step 1
    torch.testing.assert_close(defend("quant:2", [[0.0, 0.4, 0.6, 3.0]]),
                               torch.tensor([[0.0, 0.0, 1.0, 3.0]]))
    # 1 bit: the scaled sign, mean|g| · sign(g)
    torch.testing.assert_close(defend("quant:1", [[1.0, -2.0, 3.0, -2.0]]),
                               torch.tensor([[2.0, -2.0, 2.0, -2.0]]))
    # 8 bits: error at most half a step, (max − min) / 255 / 2; a constant row is unchanged
    g = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    step = (g.amax(1) - g.amin(1)) / 255
    assert ((parse_defense("quant:8").gradients(g) - g).abs().amax(1) <= step / 2 + 1e-6).all()
    torch.testing.assert_close(defend("quant:4", [[0.5, 0.5]]), torch.tensor([[0.5, 0.5]]))


def test_pruning_keeps_the_largest_magnitudes() -> None:
    torch.testing.assert_close(defend("prune:0.5", [[1.0, -4.0, 3.0, -2.0]]),
                               torch.tensor([[0.0, -4.0, 3.0, 0.0]]))
    torch.testing.assert_close(defend("prune:1", [[1.0, -4.0]]), torch.tensor([[1.0, -4.0]]))
    kept = parse_defense("prune:0.1").gradients(torch.randn(2, 1000))
    assert ((kept != 0).sum(1) == 100).all()


def test_noise_is_seeded_per_row_whatever_the_batching() -> None:
    g = torch.zeros(6, 20000)
    whole = parse_defense("noise:0.01", seed=3).gradients(g, torch.arange(6))
    parts = torch.cat([parse_defense("noise:0.01", seed=3).gradients(g[:2], torch.arange(2)),
                       parse_defense("noise:0.01", seed=3).gradients(g[2:], torch.arange(2, 6))])
    torch.testing.assert_close(whole, parts, rtol=0, atol=0)
    assert abs(float(whole.std()) - 0.01) < 2e-4
    other_seed = parse_defense("noise:0.01", seed=4).gradients(g, torch.arange(6))
    assert not torch.equal(whole, other_seed)
    assert not torch.equal(whole[0], whole[1])  # rows draw their own noise


def test_numpy_and_torch_give_the_same_result() -> None:
    g = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    chain = parse_defense("prune:0.3+quant:4+noise:0.01+dpsgd:eps=5", seed=1)
    out = chain.gradients(g)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, chain.gradients(torch.from_numpy(g)).numpy())


def test_composition_applies_left_to_right() -> None:
    g = torch.tensor([[0.1, -4.0, 3.0, -2.2, 0.7, 1.3]])
    prune_then_quant = defend("prune:0.5+quant:2", g.tolist())
    quant = parse_defense("quant:2").gradients(parse_defense("prune:0.5").gradients(g))
    torch.testing.assert_close(prune_then_quant, quant)
    assert not torch.equal(prune_then_quant, defend("quant:2+prune:0.5", g.tolist()))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
def test_dpsgd_clips_each_step_then_adds_noise_of_sigma_times_clip() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    chain = parse_defense("dpsgd:eps=5,delta=1e-5,clip=1,q=0.01,steps=500", seed=2)
    g = torch.zeros(2, 5000)
    g[0, 0], g[1, :2] = 10.0, 0.3  # norms 10 (clipped to 1) and 0.42 (kept)
    noise = chain.gradients(torch.zeros_like(g), torch.arange(2))
    signal = chain.gradients(g, torch.arange(2)) - noise
    torch.testing.assert_close(signal[0, 0], torch.tensor(1.0))
    torch.testing.assert_close(signal[1], g[1], atol=1e-6, rtol=0)
    described = chain.describe()["transforms"][0]
    expected = get_noise_multiplier(target_epsilon=5, target_delta=1e-5, sample_rate=0.01,
                                    steps=500, accountant="rdp")
    assert described["sigma"] == pytest.approx(expected)
    assert described["achieved_eps"] == pytest.approx(5.0, abs=0.05)
    assert float(noise.std()) == pytest.approx(described["sigma"], rel=0.05)
    looser = parse_defense("dpsgd:eps=10,q=0.01,steps=500").describe()["transforms"][0]
    assert looser["sigma"] < described["sigma"]  # more budget, less noise


def test_aggregation_never_crosses_an_episode_and_drops_incomplete_windows() -> None:
    g = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)
    episodes = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    stream = parse_defense("agg:2").apply(Stream.of(g, torch.arange(10), episodes))
    assert stream.sources.tolist() == [[0, 1], [2, 3], [5, 6], [7, 8]]
    torch.testing.assert_close(stream.gradients[:, 0], torch.tensor([0.5, 2.5, 5.5, 7.5]))
    assert stream.episode_ids.tolist() == [0, 0, 1, 1]
    assert stream.keys.tolist() == [1, 3, 6, 8]  # the last step of each window
    with pytest.raises(ConfigError, match="aggregates steps"):
        parse_defense("agg:2").gradients(g)


@pytest.mark.parametrize(("spec", "message"), [
    ("quant:0", "bits must be 1..16"),
    ("quant", "expected quant:BITS"),
    ("prune:1.5", "must be in (0, 1]"),
    ("prune:abc", "'abc' is not a float"),
    ("noise:-1", "σ must be >= 0"),
    ("dpsgd:eps=-1", "eps=-1.0 is out of range"),
    ("dpsgd:delta=1e-5", "expected dpsgd:eps=E"),
    ("dpsgd:eps=5,colour=red", "unknown argument 'colour'"),
    ("agg:0", "k must be >= 1"),
    ("blur:3", "unknown defense 'blur'"),
    ("prune:0.1+", "an empty step in the chain"),
])
def test_bad_specs_say_what_was_expected(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_defense(spec)


def test_none_is_the_identity() -> None:
    g = torch.randn(2, 5)
    torch.testing.assert_close(parse_defense("none").gradients(g), g, rtol=0, atol=0)


def test_update_distortion_by_hand() -> None:
    from gradleak.defenses.utility import block_distortion

    g = torch.tensor([[1.0, 0.0], [1.0, 2.0], [3.0, 0.0], [3.0, 2.0]])
    stream = Stream.of(g, torch.arange(4), [0, 0, 0, 0])
    assert block_distortion(parse_defense("none"), stream) == pytest.approx((1.0, 0.0))
    # (the defended mean is float32's, the clean one summed in float64: float32 rounding apart)
    assert block_distortion(parse_defense("agg:2"), stream) == pytest.approx((1.0, 0.0), abs=1e-7)
    # prune:0.5 keeps the larger entry of each row: (1,0), (0,2), (3,0), (3,0), mean (1.75, 0.5),
    # against the clean mean (2, 1)
    cosine, error = block_distortion(parse_defense("prune:0.5"), stream)
    assert cosine == pytest.approx(4.0 / (np.sqrt(3.3125) * np.sqrt(5)))
    assert error == pytest.approx(np.sqrt(0.3125) / np.sqrt(5))
    # agg over 3 steps drops the 4th: the reference is the mean of the 3 covered steps
    assert block_distortion(parse_defense("agg:3"), stream) == pytest.approx((1.0, 0.0), abs=1e-7)


@pytest.mark.parametrize("spec", ["prune:0.3+noise:1e-3", "agg:3", "dpsgd:eps=1"])
def test_the_update_distortion_read_in_pieces_is_the_whole_blocks(random_capture, spec: str
                                                                  ) -> None:
    """A block is defended a few rows at a time (bounded memory) and gives what the whole block
    defended at once gives: per-row noise is keyed by row, aggregation windows are never cut."""
    from gradleak.capture.reader import CaptureFile
    from gradleak.capture.schema import GRADIENTS
    from gradleak.defenses.base import row_keys
    from gradleak.defenses.utility import block_distortion, update_distortion

    chain = parse_defense(spec, seed=3)
    pieces = update_distortion(chain, random_capture, steps_per_update=25, updates=2,
                               rows_at_once=4)
    with CaptureFile(random_capture) as capture:
        wholes: list[tuple[float, float]] = []
        for start in (0, 25):
            rows = slice(start, start + 25)
            stream = Stream.of(capture.column(GRADIENTS, rows).astype(np.float32),
                               row_keys(capture.attrs, start, start + 25),
                               capture.column("episode_ids", rows))
            wholes.append(block_distortion(chain, stream))
    assert pieces["updates"] == 2
    cosines, errors = zip(*wholes)
    assert pieces["cosine"] == pytest.approx(float(np.median(cosines)), abs=1e-9)
    assert pieces["relative_norm_error"] == pytest.approx(float(np.median(errors)), abs=1e-9)


def test_pieces_cut_no_aggregation_window() -> None:
    from gradleak.defenses.utility import pieces

    episodes = np.repeat([0, 1, 2, 3], [7, 2, 11, 5])
    cuts = pieces(episodes, span=3, size=4)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(episodes)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))  # consecutive, covering all
    starts = {0, 7, 9, 20}
    for first, _ in cuts[1:]:
        episode_start = max(s for s in starts if s <= first)
        assert (first - episode_start) % 3 == 0, (first, cuts)
    assert max(last - first for first, last in cuts) <= 6  # about `size`, a window at most more
