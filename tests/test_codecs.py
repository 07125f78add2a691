"""Wire codecs: round-trip error within each format's bound, refusal of inf/NaN, byte savings,
and the coded collectives on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from neorec.config import _COMM_CODECS, ConfigError, load_config
from neorec.distributed.codecs import CODECS, Codec, CodecError, make_codec
from neorec.distributed.comm import CommStats, coded_all_reduce, coded_all_to_all
from neorec.sparse import SparseFeatures

LOSSY = [c for c in CODECS if c != "fp32"]
VARIANTS = [(c, s) for c in LOSSY for s in (["row", "tensor"] if c.startswith("fp8") else ["row"])]


def codec(name: str, scaling: str = "row", loss_scale: float = 0.0) -> Codec:
    c = make_codec(name, scaling, loss_scale)
    assert c is not None
    return c


def nasty(seed: int = 0) -> torch.Tensor:
    """Rows spanning 1e-30 .. 1e30, an all-zero row, zeros inside rows, fp32 subnormals, signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 24, generator=g) * torch.logspace(-30, 30, 40).unsqueeze(1)
    x[3] = 0.0
    x[5, ::2] = 0.0
    x[7, 0] = 1e-40
    x[9] = -x[9].abs()
    return x


@pytest.mark.parametrize("name,scaling", VARIANTS)
def test_round_trip_within_bound(name, scaling):
    c = codec(name, scaling)
    g = torch.Generator().manual_seed(1)
    cases = [nasty(), torch.randn(64, 16, generator=g), torch.randn(8, 16, generator=g) * 1e-6]
    cases += [torch.zeros(4, 8), torch.randn(1, 1, generator=g), torch.zeros(0, 16)]
    for x in cases:
        buf = c.encode(x)
        assert buf.dtype == torch.uint8 and buf.numel() == c.nbytes(*x.shape)
        y = c.decode(buf, *x.shape)
        err, bound = (y - x).abs(), c.bound(x)
        assert bool((err <= bound).all()), (name, scaling, float((err - bound).max()))
        assert bool((y[x == 0] == 0).all())


def test_bounds_are_tight():
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(2))
    rel = {"fp16": 2**-11, "bf16": 2**-8, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}
    for name, r in rel.items():
        c = codec(name)
        y = c.decode(c.encode(x), *x.shape)
        worst = float(((y - x).abs() / x.abs().clamp(min=1e-3)).max())
        assert r / 4 < worst <= r * 1.01, (name, worst)
    c = codec("int8")
    y = c.decode(c.encode(x), *x.shape)
    step = (x.amax(1) - x.amin(1)) / 255
    assert bool(((y - x).abs() <= 0.5 * step.unsqueeze(1) * (1 + 2**-8)).all())


def test_int8_device_units_equal_the_host_ones():
    """The int8 codec's scale units, computed on the device (no host read), are the host's
    ``int_rowwise_quantize`` units bit for bit (powers of two, subnormals, zeros, 2^k +- 1 ulp),
    and so are its codes; decoding with device units gives the host dequantization's bits."""
    from neorec.ops import quant
    from neorec.ops.quant import (
        dequantize_rows,
        int_rowwise_dequantize,
        int_rowwise_quantize,
        int_rowwise_quantize_device,
    )

    p2 = torch.tensor([2.0**k for k in range(-140, 120, 7)])
    edges = torch.cat([p2, torch.nextafter(p2, p2 * 2), torch.nextafter(p2, p2 * 0)])
    g = torch.Generator().manual_seed(4)
    cases = [nasty(), torch.zeros(3, 5), torch.zeros(0, 4), torch.randn(50, 9, generator=g) * 1e-3]
    cases += [torch.stack([edges, -edges * 0.5, edges * 0.25], 1), edges.view(-1, 1)]
    for v in edges.tolist() + [0.0, 1e-45, 3.0e38]:  # each value the largest of its call
        x = torch.tensor([[-v, v]])
        host = torch.tensor(quant._pow2_unit(x[0]), dtype=torch.float32)  # (2^128: inf)
        assert torch.equal(quant._pow2_unit_device(x[0]), host), v
    for x in cases:
        q = int_rowwise_quantize(x, 8)
        qd, units = int_rowwise_quantize_device(x, 8)
        assert units.tolist() == [q.scale_unit, q.offset_unit]
        assert torch.equal(qd.packed, q.packed) and torch.equal(qd.scale, q.scale)
        assert torch.equal(qd.offset, q.offset)
        assert torch.equal(dequantize_rows(qd, units), int_rowwise_dequantize(q))


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_refused_with_clear_error(name, bad):
    x = torch.randn(4, 8)
    x[2, 3] = bad
    with pytest.raises(CodecError, match=rf"{name} codec: 1 non-finite value.*bwd_grads"):
        codec(name).encode(x, "bwd_grads")


def test_static_loss_scale_overflow_is_an_error():
    c = codec("fp16", loss_scale=2.0**20)
    x = torch.full((2, 4), 1e-6)
    torch.testing.assert_close(c.decode(c.encode(x), 2, 4), x, rtol=2**-11, atol=0)
    with pytest.raises(CodecError, match="overflows fp16.*comm.loss_scale"):
        c.encode(torch.full((2, 4), 1.0), "bwd_grads")


def test_loss_scaling_keeps_small_gradients():
    # Typical pooled-embedding gradients (~1e-7): plain fp16 would flush them to subnormals.
    g = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)) * 1e-7
    c = codec("fp16")
    rel = ((c.decode(c.encode(g), 64, 16) - g).abs() / g.abs()).max()
    assert float(rel) <= 2**-11
    plain = (g.half().float() - g).abs() / g.abs()
    assert float(plain.max()) > 0.01


def test_bytes_on_the_wire():
    n, d = 256, 16
    fp32 = n * d * 4
    ratio = {name: fp32 / codec(name).nbytes(n, d) for name in LOSSY}
    assert ratio["fp16"] == pytest.approx(2, rel=0.01) and ratio["bf16"] == 2
    assert ratio["fp8_e4m3"] == pytest.approx(4 * 16 / 17, rel=0.01)  # one exponent byte per row
    assert fp32 / codec("fp8_e4m3", "tensor").nbytes(n, d) == pytest.approx(4, rel=0.01)
    assert ratio["int8"] == pytest.approx(64 / 20, rel=0.01)  # fp16 scale + offset per row


def test_config_names_match_and_validate():
    assert tuple(_COMM_CODECS) == CODECS
    with pytest.raises(ConfigError, match="comm.forward must be one of"):
        load_config(overrides=["comm.forward='fp7'"])
    with pytest.raises(ConfigError, match="train.pipeline must be"):
        load_config(overrides=["train.pipeline='async'"])
    with pytest.raises(ValueError, match="unknown comm codec"):
        make_codec("fp4")


def _collectives(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(10 + rank)
    rows = 5
    send_splits = [rows * (8 + 8 * q) for q in range(world)]  # chunk q: [5, 8 + 8q]
    recv_splits = [rows * (8 + 8 * rank)] * world
    send = torch.randn(sum(send_splits), generator=g)
    exact = coded_all_to_all(send, send_splits, recv_splits, rows, None).wait()
    for name in LOSSY:
        c = codec(name)
        stats = CommStats()
        y = coded_all_to_all(send, send_splits, recv_splits, rows, c, None, stats, "x").wait()
        assert y.shape == exact.shape
        parts = torch.split(exact, recv_splits)
        bound = torch.cat([c.bound(p.view(rows, -1)).reshape(-1) for p in parts])
        assert bool(((y - exact).abs() <= bound).all()), name
        assert stats.bytes_sent["x"] < 4 * (sum(send_splits) - send_splits[rank])
    t = torch.randn(1000, generator=g)
    total = t.clone()
    torch.distributed.all_reduce(total)
    for name in ("fp16", "bf16", "fp8_e4m3", "int8"):
        out = coded_all_reduce(t, codec(name))
        tol = {"fp16": 2e-3, "bf16": 2e-2, "fp8_e4m3": 0.3, "int8": 0.1}[name]
        assert float((out - total).abs().max()) < tol * float(total.abs().max()), name
        everyone = [torch.empty_like(out) for _ in range(world)]
        torch.distributed.all_gather(everyone, out)
        assert all(torch.equal(e, out) for e in everyone), f"{name}: ranks disagree"


@pytest.mark.bitwise
@pytest.mark.parametrize("world", [2, 3])
def test_coded_collectives(world):
    run_ranks(_collectives, world)


def _dp_codec_run(rank: int, world: int) -> None:
    # Data-parallel tables' row gradients under comm.allreduce: every rank decodes the same
    # bytes, so replicas stay bitwise identical; the tables end close to the fp32 run's, and the
    # all-gather sends fewer bytes.
    from neorec.builder import sharded_collection
    from neorec.config import (
        CommConfig,
        Config,
        DataConfig,
        EmbeddingConfig,
        ModelConfig,
        TableConfig,
    )
    from neorec.sharding.fixed_plan import plan_by_type

    tables = [TableConfig(name="a", rows=40, dim=8), TableConfig(name="b", rows=3, dim=8)]
    results = {}
    for name in ("fp32", "bf16", "int8"):
        cfg = Config(
            model=ModelConfig(num_dense=2, bottom_mlp=[8], top_mlp=[4, 1]),
            embedding=EmbeddingConfig(tables=tables, optimizer="rowwise_adagrad", lr=0.1),
            data=DataConfig(batch_size=8),
            comm=CommConfig(allreduce=name),
        )
        plan = plan_by_type(tables, world, world, "data_parallel")
        ebc = sharded_collection(cfg, plan)
        ebc.dp_dense_max_elems = 0  # fp32 as (id, row) pairs too, as the codecs send them
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            lengths = torch.randint(0, 4, (2 * 4,), generator=g)
            n_a, n_b = int(lengths[:4].sum()), int(lengths[4:].sum())
            values = torch.cat(
                [
                    torch.randint(0, 40, (n_a,), generator=g),
                    torch.randint(0, 3, (n_b,), generator=g),
                ]
            )
            sparse = SparseFeatures(["a", "b"], values, lengths)
            (ebc(sparse) * torch.randn(4, 16, generator=g)).sum().backward()
        mine = torch.cat([ebc.gather_table(t.name).flatten() for t in tables])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(everyone, mine)
        assert all(torch.equal(e, mine) for e in everyone), f"{name}: replicas differ"
        results[name] = (mine, ebc.comm_stats.bytes_sent["dp_allgather"])
    exact, exact_bytes = results["fp32"]
    for name, tol in (("bf16", 2e-2), ("int8", 5e-2)):
        got, sent = results[name]
        assert not torch.equal(got, exact)  # the codec was used
        assert float((got - exact).abs().max()) < tol * float(exact.abs().max()), name
        assert sent < exact_bytes, (name, sent, exact_bytes)


def test_data_parallel_row_gradients_use_the_allreduce_codec():
    run_ranks(_dp_codec_run, 2)
