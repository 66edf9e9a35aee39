"""flashkda_ext.integrations.common_checks: the adapters' int32 narrowing never wraps a value."""
import pytest
import torch

from flashkda_ext.integrations.common_checks import (INT32_MAX, INT32_MIN, host_values, narrow_int32,
                                                     unchecked_on_device)


def test_host_values_in_range_are_narrowed_exactly():
    x = torch.tensor([[INT32_MIN, -1], [0, 4]], dtype=torch.int64)
    y = narrow_int32("ssm_state_indices", x, high=4)
    assert y.dtype == torch.int32 and torch.equal(y.long(), x)
    small = torch.tensor([3, -2], dtype=torch.int16)            # widened, checked all the same
    assert torch.equal(narrow_int32("i", small), small.int())
    with pytest.raises(ValueError, match=r"i: entry \[0\] = 3 is out of range"):
        narrow_int32("i", small, high=2)


@pytest.mark.parametrize("value", [2 ** 32 + 1, 2 ** 31, INT32_MIN - 1, -(2 ** 32) + 1])
def test_a_value_that_would_wrap_is_refused_naming_the_argument_and_entry(value):
    """2**32 + 1 would become slot 1 under a plain .to(torch.int32); refused, naming the argument."""
    x = torch.tensor([[0, 1], [2, value]], dtype=torch.int64)
    assert x.to(torch.int32)[1, 1].item() != value                # what a plain cast does
    with pytest.raises(ValueError, match=rf"^ssm_state_indices: entry \[1, 1\] = {value} is out of range"):
        narrow_int32("ssm_state_indices", x)


def test_the_range_given_by_the_adapter_is_the_one_checked():
    counts = torch.tensor([1, 3, 0], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"num_accepted_tokens: entry \[2\] = 0 .* \[1, 3\] \(T_max\)"):
        narrow_int32("num_accepted_tokens", counts, 1, 3, what=" (T_max)")
    assert narrow_int32("num_accepted_tokens", counts[:2], 1, 3).tolist() == [1, 3]
    # a range wider than int32 is clipped to int32 (nothing outside it can be narrowed)
    with pytest.raises(ValueError, match="out of range"):
        narrow_int32("x", torch.tensor([2 ** 40]), high=2 ** 50)


def test_int32_none_and_float_pass_untouched():
    x = torch.tensor([5, 2 ** 31 - 1], dtype=torch.int32)
    assert narrow_int32("x", x, high=3) is x                     # int32: nothing to narrow (the op checks values)
    f = torch.zeros(2)
    assert narrow_int32("x", f) is f and narrow_int32("x", None) is None


def test_device_values_become_padding_without_a_host_read(monkeypatch):
    """On a device the values are never read: out-of-range entries become the padding value in the
    narrowing pass itself. Run on meta tensors (no data: any read would fail) for the no-read part and
    with a device stand-in for the values."""
    m = torch.empty(4, dtype=torch.int64, device="meta")
    assert not host_values(m) and unchecked_on_device(m) and not unchecked_on_device(m.int())
    out = narrow_int32("ssm_state_indices", m, high=5, pad=-1)
    assert out.dtype == torch.int32 and out.device.type == "meta"
    with pytest.raises(ValueError, match="^cu_seqlens: .* without a device-to-host copy"):
        narrow_int32("cu_seqlens", m)
    # the same pass on values, as a device would run it
    from flashkda_ext.integrations import common_checks
    monkeypatch.setattr(common_checks, "host_values", lambda x: False)
    x = torch.tensor([2 ** 32 + 1, 4, -1, 5, INT32_MIN - 7], dtype=torch.int64)
    assert narrow_int32("ssm_state_indices", x, high=4, pad=-1).tolist() == [-1, 4, -1, -1, -1]
    assert narrow_int32("num_accepted_tokens", torch.tensor([0, 1, 2, 2 ** 32 + 1]), 1, 2, pad=0).tolist() == \
        [0, 1, 2, 0]
