import pytest
import torch

from neorec.sparse import SparseFeatureError, SparseFeatures


def make() -> SparseFeatures:
    return SparseFeatures.from_lists(
        {"a": [[1, 2], [], [3]], "b": [[0], [4, 4, 1], []]},
        weights={"a": [[0.5, 1.0], [], [2.0]], "b": [[1.0], [1.0, 2.0, 3.0], []]},
    )


def test_layout_and_feature_access():
    sf = make()
    assert sf.batch_size == 3
    assert sf.lengths.tolist() == [2, 0, 1, 1, 3, 0]
    assert sf.offsets().tolist() == [0, 2, 2, 3, 4, 7, 7]
    v, lens, w = sf.feature("b")
    assert v.tolist() == [0, 4, 4, 1] and lens.tolist() == [1, 3, 0]
    assert w is not None and w.tolist() == [1.0, 1.0, 2.0, 3.0]
    with pytest.raises(KeyError, match="feature 'zz'"):
        sf.feature("zz")


def test_select_samples():
    sf = make()
    part = sf.select_samples(1, 3)
    assert part.batch_size == 2
    assert part.lengths.tolist() == [0, 1, 3, 0]
    assert part.values.tolist() == [3, 4, 4, 1]
    assert part.weights is not None and part.weights.tolist() == [2.0, 1.0, 2.0, 3.0]


def test_validate_ok():
    make().validate({"a": 5, "b": 5})


@pytest.mark.parametrize(
    "values, lengths, rows, match",
    [
        ([1, 2, 3], [2, -1, 2, 0], 10, r"feature 'a' sample 1: negative length -1"),
        ([1, 2, 3], [2, 0, 0, 0], 10, r"lengths sum to 2 but there are 3 values"),
        ([1, -2, 3], [2, 0, 1, 0], 10, r"feature 'a' \(table 'T_a'\): id -2 < 0"),
        ([1, 2, 10], [2, 0, 1, 0], 10, r"feature 'b' \(table 'T_b'\): id 10 >= table rows 10"),
    ],
)
def test_validate_errors(values, lengths, rows, match):
    sf = SparseFeatures(["a", "b"], torch.tensor(values), torch.tensor(lengths))
    with pytest.raises(SparseFeatureError, match=match):
        sf.validate({"a": rows, "b": rows}, {"a": "T_a", "b": "T_b"})


def test_non_integer_ids():
    # Refused when the batch is built (earlier than validate, which checks it again).
    with pytest.raises(SparseFeatureError, match="integer ids"):
        SparseFeatures(["a"], torch.tensor([1.0, 2.0]), torch.tensor([2]))
    sf = SparseFeatures(["a"], torch.tensor([1, 2]), torch.tensor([2]))
    sf.values = torch.tensor([1.0, 2.0])  # swapped in after construction
    with pytest.raises(SparseFeatureError, match="ids must be integers"):
        sf.validate({"a": 4})


def test_construction_errors():
    with pytest.raises(SparseFeatureError, match="not a multiple of 2 features"):
        SparseFeatures(["a", "b"], torch.tensor([1]), torch.tensor([1, 0, 0]))
    with pytest.raises(SparseFeatureError, match="duplicate feature keys"):
        SparseFeatures(["a", "a"], torch.tensor([1]), torch.tensor([1, 0]))
    with pytest.raises(SparseFeatureError, match="weights must be a tensor shaped like values"):
        SparseFeatures(["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.ones(3))


def test_per_id_weights_must_be_finite_and_of_the_tables_dtype():
    sf = make()
    assert sf.weights is not None
    sf.weights[4] = float("nan")  # feature 'b', sample 1
    with pytest.raises(SparseFeatureError, match=r"feature 'b' sample 1: per-id weight nan"):
        sf.validate()
    sf = make()
    sf.weights = sf.weights.double()  # type: ignore[union-attr]
    sf.validate()  # no dtype asked for
    with pytest.raises(SparseFeatureError, match="float64, the tables torch.float32"):
        sf.validate(weight_dtype=torch.float32)
    with pytest.raises(SparseFeatureError, match="must be floating point"):
        SparseFeatures(["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1, 2]))


def test_construction_refuses_what_it_would_misread():
    with pytest.raises(SparseFeatureError, match="list of feature names"):
        SparseFeatures("ab", torch.tensor([1]), torch.tensor([1, 0]))  # type: ignore[arg-type]
    with pytest.raises(SparseFeatureError, match="meta"):
        SparseFeatures(["a"], torch.tensor([1], device="meta"), torch.tensor([1], device="meta"))
    with pytest.raises(SparseFeatureError, match="does not fit int64"):
        SparseFeatures.from_lists({"a": [[2**63]]})
    with pytest.raises(SparseFeatureError, match="id 1.5 is not an integer"):
        SparseFeatures.from_lists({"a": [[1.5]]})
    sf = SparseFeatures(["a", "b"], torch.tensor([1, 2]), torch.tensor([2**62, 0, 0, 0]))
    with pytest.raises(SparseFeatureError, match="length 4611686018427387904 exceeds the 2"):
        sf.validate()


def test_zero_sample_batch_is_valid():
    sf = SparseFeatures(
        ["a", "b"], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert sf.batch_size == 0
    sf.validate({"a": 3, "b": 3})
