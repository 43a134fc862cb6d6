"""Block-sparse layouts: hand-worked DeepSpeed layouts for every config and option, seeded
random blocks, validation errors, and the DeepSpeed `sparse_attention` config block."""

import dataclasses

import numpy as np
import pytest

from jaxspeed.attention.sparsity import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)
from jaxspeed.errors import ConfigError

BI, UNI = "bidirectional", "unidirectional"


def grid(text):
    """A layout written as rows of 0/1 characters, e.g. "1100 / 1100 / 0011 / 0011"."""
    return np.array([[int(c) for c in row.strip()] for row in text.split("/")])


def assert_layout(config, seq_len, *expected_heads):
    """Checks shape, dtype and every head; one expected grid means all heads share it."""
    layout = config.make_layout(seq_len)
    nb = seq_len // config.block
    assert layout.shape == (config.num_heads, nb, nb)
    assert layout.dtype == np.int32
    heads = expected_heads * config.num_heads if len(expected_heads) == 1 else expected_heads
    np.testing.assert_array_equal(layout, np.stack([grid(h) for h in heads]))


# ---- Dense ------------------------------------------------------------------------------------


def test_dense_is_all_ones():
    assert_layout(DenseSparsityConfig(2), 48, "111/111/111")
    assert_layout(DenseSparsityConfig(1, block=8, different_layout_per_head=True), 16, "11/11")


# ---- Fixed (4 blocks of 16, windows of 2, one global block at each window's end) --------------


@pytest.mark.parametrize(
    "attention, horizontal, expected",
    [
        (BI, False, "1101/1101/0111/0111"),
        (UNI, False, "1000/1100/0110/0111"),
        (BI, True, "1101/1111/0111/1111"),
    ],
)
def test_fixed_four_blocks(attention, horizontal, expected):
    config = FixedSparsityConfig(
        3, num_local_blocks=2, num_global_blocks=1, attention=attention,
        horizontal_global_attention=horizontal,
    )
    assert_layout(config, 64, expected)


@pytest.mark.parametrize(
    "attention, expected",
    [(BI, "11011/11011/01111/01111/01011"), (UNI, "10000/11000/01100/01110/01011")],
)
def test_fixed_short_last_window_keeps_its_global_block(attention, expected):
    config = FixedSparsityConfig(1, num_local_blocks=2, num_global_blocks=1, attention=attention)
    assert_layout(config, 80, expected)


def test_fixed_unidirectional_global_span_covers_itself():
    # DeepSpeed's global columns start at the global block's first row, so with two global
    # blocks the first one also sees the second (row 2, column 3).
    config = FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=2, attention=UNI)
    assert_layout(config, 64, "1000/1100/1111/1111")


def test_fixed_default_arguments():
    # num_local_blocks=4, num_global_blocks=1, bidirectional: block 3 of each window is global.
    assert_layout(
        FixedSparsityConfig(1),
        16 * 8,
        "11110001/11110001/11110001/11110001/00011111/00011111/00011111/00011111",
    )


def test_fixed_different_global_patterns_per_head():
    config = FixedSparsityConfig(
        3, num_local_blocks=2, num_global_blocks=1, different_layout_per_head=True,
        num_different_global_patterns=2,
    )
    # Head 0 uses each window's last block as global, head 1 the first, head 2 = head 0.
    assert_layout(config, 64, "1101/1101/0111/0111", "1110/1110/1011/1011", "1101/1101/0111/0111")


def test_fixed_different_layout_per_head_with_one_pattern_is_shared():
    config = FixedSparsityConfig(2, num_local_blocks=2, different_layout_per_head=True)
    assert_layout(config, 64, "1101/1101/0111/0111")


# ---- Variable ---------------------------------------------------------------------------------


def test_variable_windows_repeat_the_last_size():
    # Windows {0}, {1, 2}, then size 2 again: {3, 4}, {5}; block 0 is global.
    config = VariableSparsityConfig(2, block=4, local_window_blocks=[1, 2])
    assert_layout(config, 24, "100000/111000/111000/100110/100110/100001")


def test_variable_global_ranges_unidirectional():
    config = VariableSparsityConfig(
        1, local_window_blocks=[2], global_block_indices=[1, 4], global_block_end_indices=[3, 9],
        attention=UNI,
    )
    assert_layout(config, 96, "100000/111000/011000/011100/011011/011011")


def test_variable_global_ranges_horizontal():
    config = VariableSparsityConfig(
        1, local_window_blocks=[2], global_block_indices=[1, 4], global_block_end_indices=[3, 9],
        horizontal_global_attention=True,
    )
    assert_layout(config, 96, "111011/111111/111111/011111/111111/111111")


def test_variable_global_indices_unidirectional_and_out_of_range():
    # Index 2 is global from row 2 on; index 7 lies past the 4 blocks and is skipped.
    config = VariableSparsityConfig(1, local_window_blocks=[4], global_block_indices=[2, 7],
                                    attention=UNI)
    assert_layout(config, 64, "1000/1100/1110/1111")
    config = VariableSparsityConfig(1, local_window_blocks=[1], global_block_indices=[2, 7])
    assert_layout(config, 64, "1010/0110/0010/0011")


def test_variable_random_blocks_add_to_the_fixed_part():
    base = VariableSparsityConfig(4, local_window_blocks=[1], global_block_indices=[])
    config = dataclasses.replace(base, num_random_blocks=2, seed=3)
    layout = config.make_layout(16 * 12)
    fixed = base.make_layout(16 * 12)
    assert np.all(layout >= fixed)
    extra = (layout - fixed).sum(-1)
    assert np.all((extra >= 1) & (extra <= 2))  # 2 distinct draws, one may be the diagonal
    np.testing.assert_array_equal(layout, config.make_layout(16 * 12))  # deterministic
    assert np.all(layout == layout[0])  # one layout for all heads
    # As DeepSpeed, Variable draws from the whole row even when unidirectional.
    uni = dataclasses.replace(config, attention=UNI, num_random_blocks=6).make_layout(16 * 12)
    assert np.triu(uni[0], 1).any()


# ---- BigBird ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attention, expected",
    [(BI, "11111/11100/11110/10111/10011"), (UNI, "10000/11000/11100/10110/10011")],
)
def test_bigbird_window_and_global(attention, expected):
    config = BigBirdSparsityConfig(2, num_random_blocks=0, attention=attention)
    assert_layout(config, 80, expected)


def test_bigbird_two_global_blocks_and_wide_window():
    config = BigBirdSparsityConfig(1, block=2, num_random_blocks=0, num_global_blocks=2,
                                   num_sliding_window_blocks=5)
    assert_layout(config, 12, "111111/111111/111110/111111/111111/110111")


def test_bigbird_random_blocks_are_seeded():
    nb = 16
    config = BigBirdSparsityConfig(4, block=1, num_random_blocks=3, num_sliding_window_blocks=0,
                                   num_global_blocks=0, seed=7)
    layout = config.make_layout(nb)
    np.testing.assert_array_equal(layout, config.make_layout(nb))
    np.testing.assert_array_equal(layout, BigBirdSparsityConfig(
        4, block=1, num_random_blocks=3, num_sliding_window_blocks=0, num_global_blocks=0, seed=7,
    ).make_layout(nb))
    assert np.all(layout == layout[0])
    row_sums = layout[0].sum(-1)  # diagonal (window of 0) plus 3 distinct random blocks
    assert np.all((row_sums >= 3) & (row_sums <= 4))
    assert np.all(np.diagonal(layout[0]) == 1)
    other = dataclasses.replace(config, seed=8).make_layout(nb)
    assert not np.array_equal(layout, other)


def test_bigbird_random_blocks_differ_per_head_and_stay_causal():
    config = BigBirdSparsityConfig(3, block=1, num_random_blocks=2, different_layout_per_head=True,
                                   attention=UNI, seed=1)
    layout = config.make_layout(24)
    assert not np.array_equal(layout[0], layout[1])
    assert not np.triu(layout, 1).any()
    # Row 0 has one past block, fewer than num_random_blocks: it takes what there is.
    assert layout[:, 0].sum() == 3
    deterministic = dataclasses.replace(config, num_random_blocks=0).make_layout(24)
    assert np.all(layout >= deterministic)


# ---- BSLongformer -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attention, expected",
    [(BI, "10100/01100/11111/00110/00101"), (UNI, "10000/01000/11100/00110/00101")],
)
def test_bslongformer_global_index(attention, expected):
    config = BSLongformerSparsityConfig(1, num_sliding_window_blocks=1, global_block_indices=[2],
                                        attention=attention)
    assert_layout(config, 80, expected)


def test_bslongformer_global_end_indices():
    config = BSLongformerSparsityConfig(
        2, block=8, num_sliding_window_blocks=1, global_block_indices=[1, 9],
        global_block_end_indices=[3, 12],
    )
    assert_layout(config, 48, "111000/111111/111111/011100/011010/011001")


def test_bslongformer_defaults():
    # Window of 3 blocks and block 0 global: the same as BigBird without random blocks.
    assert_layout(BSLongformerSparsityConfig(1), 80, "11111/11100/11110/10111/10011")


# ---- LocalSlidingWindow -----------------------------------------------------------------------


def test_local_sliding_window():
    assert_layout(LocalSlidingWindowSparsityConfig(2), 80, "10000/11000/01100/00110/00011")
    bi5 = "11100/11110/11111/01111/00111"
    assert_layout(LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=5, attention=BI),
                  80, bi5)
    # Even windows round down to 2 * (size // 2) + 1 blocks, as DeepSpeed.
    assert_layout(LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=4, attention=BI),
                  80, bi5)


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        DenseSparsityConfig(1),
        FixedSparsityConfig(1),
        VariableSparsityConfig(1),
        BigBirdSparsityConfig(1),
        BSLongformerSparsityConfig(1),
        LocalSlidingWindowSparsityConfig(1),
    ],
    ids=lambda c: type(c).__name__,
)
def test_seq_len_must_be_a_multiple_of_block(config):
    with pytest.raises(ValueError, match=r"seq_len=100 is invalid; .*divisible by block=16"):
        config.make_layout(100)
    with pytest.raises(ConfigError, match="seq_len=0"):
        config.make_layout(0)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (FixedSparsityConfig, dict(num_local_blocks=4, num_global_blocks=3),
         r"num_global_blocks=3 is invalid; it must divide num_local_blocks=4"),
        (FixedSparsityConfig, dict(attention="causal"),
         r"attention='causal' is invalid; accepted values are "
         r"\['bidirectional', 'unidirectional'\]"),
        (FixedSparsityConfig, dict(attention=UNI, horizontal_global_attention=True),
         r"horizontal_global_attention=True is invalid; .*attention='bidirectional'"),
        (FixedSparsityConfig, dict(num_different_global_patterns=2),
         r"num_different_global_patterns=2 is invalid; .*different_layout_per_head=True"),
        (FixedSparsityConfig, dict(different_layout_per_head=True, num_local_blocks=4,
                                   num_global_blocks=2, num_different_global_patterns=3),
         r"num_different_global_patterns=3 is invalid; at most .* 4 // 2 = 2"),
        (FixedSparsityConfig, dict(num_global_blocks=0), r"num_global_blocks=0 .*integer >= 1"),
        (FixedSparsityConfig, dict(num_different_global_patterns=0), r"patterns=0 .*>= 1"),
        (FixedSparsityConfig, dict(block=0), r"block=0 is invalid; expected an integer >= 1"),
        (FixedSparsityConfig, dict(block=16.0), r"block=16.0 is invalid"),
        (FixedSparsityConfig, dict(different_layout_per_head="yes"),
         r"different_layout_per_head='yes' is invalid; expected true or false"),
        (VariableSparsityConfig, dict(global_block_indices=[0, 4], global_block_end_indices=[2]),
         r"global_block_end_indices=\[2\] is invalid; .*as many entries as .*\[0, 4\]"),
        (VariableSparsityConfig, dict(global_block_indices=[3], global_block_end_indices=[3]),
         r"start 3 >= end 3"),
        (VariableSparsityConfig, dict(attention=UNI, horizontal_global_attention=True),
         r"horizontal_global_attention=True"),
        (VariableSparsityConfig, dict(attention="bi"), r"attention='bi' is invalid"),
        (VariableSparsityConfig, dict(local_window_blocks=[]), r"local_window_blocks=\[\]"),
        (VariableSparsityConfig, dict(local_window_blocks=[2, 0]), r"local_window_blocks=\[2, 0\]"),
        (VariableSparsityConfig, dict(global_block_indices=[-1]),
         r"global_block_indices=\[-1\] is invalid; expected a list of integers >= 0"),
        (VariableSparsityConfig, dict(num_random_blocks=-1), r"num_random_blocks=-1"),
        (BigBirdSparsityConfig, dict(attention="none"), r"attention='none'"),
        (BigBirdSparsityConfig, dict(num_global_blocks=-1), r"num_global_blocks=-1"),
        (BSLongformerSparsityConfig, dict(global_block_indices=[5], global_block_end_indices=[1]),
         r"start 5 >= end 1"),
        (BSLongformerSparsityConfig, dict(attention="x"), r"attention='x'"),
        (LocalSlidingWindowSparsityConfig, dict(attention="x"), r"attention='x'"),
        (LocalSlidingWindowSparsityConfig, dict(num_sliding_window_blocks=-3),
         r"num_sliding_window_blocks=-3"),
    ],
)
def test_invalid_arguments(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        cls(4, **kwargs)
    assert isinstance(info.value, ValueError)
    assert cls.__name__ in str(info.value)


@pytest.mark.parametrize("num_heads", [0, True, "4"])
def test_invalid_num_heads(num_heads):
    with pytest.raises(ConfigError, match="num_heads"):
        FixedSparsityConfig(num_heads)


@pytest.mark.parametrize(
    "config, name",
    [
        (VariableSparsityConfig(1, num_random_blocks=5), "num_random_blocks=5"),
        (BigBirdSparsityConfig(1, num_random_blocks=5), "num_random_blocks=5"),
        (BigBirdSparsityConfig(1, num_sliding_window_blocks=5), "num_sliding_window_blocks=5"),
        (BigBirdSparsityConfig(1, num_global_blocks=5), "num_global_blocks=5"),
        (BSLongformerSparsityConfig(1, num_sliding_window_blocks=5), "num_sliding_window_blocks=5"),
        (LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=5),
         "num_sliding_window_blocks=5"),
    ],
)
def test_too_many_blocks_for_the_sequence(config, name):
    with pytest.raises(ConfigError, match=rf"{name} is invalid; at most the 4 blocks of a row"):
        config.make_layout(64)
    assert config.make_layout(80).shape[-1] == 5


def test_arguments_are_keyword_only_and_configs_hashable():
    with pytest.raises(TypeError):
        FixedSparsityConfig(4, 16)
    config = VariableSparsityConfig(2, local_window_blocks=[2, 4], global_block_indices=[0])
    assert config.local_window_blocks == (2, 4)
    assert hash(config) == hash(VariableSparsityConfig(2, local_window_blocks=(2, 4)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block = 32


# ---- DeepSpeed's `sparse_attention` block ----------------------------------------------------


@pytest.mark.parametrize(
    "block, expected",
    [
        ({"mode": "dense", "block": 32}, DenseSparsityConfig(4, block=32)),
        ({}, FixedSparsityConfig(4)),
        ({"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
          "num_global_blocks": 1, "attention": "bidirectional",
          "horizontal_global_attention": False, "num_different_global_patterns": 4},
         FixedSparsityConfig(4, different_layout_per_head=True, num_different_global_patterns=4)),
        ({"mode": "variable", "num_random_blocks": 1, "local_window_blocks": [4, 8],
          "global_block_indices": [0, 5], "global_block_end_indices": [2, 6], "seed": 3},
         VariableSparsityConfig(4, num_random_blocks=1, local_window_blocks=(4, 8),
                                global_block_indices=(0, 5), global_block_end_indices=(2, 6),
                                seed=3)),
        ({"mode": "bigbird", "num_random_blocks": 2, "num_sliding_window_blocks": 5,
          "num_global_blocks": 2, "num_heads": 4},
         BigBirdSparsityConfig(4, num_random_blocks=2, num_sliding_window_blocks=5,
                               num_global_blocks=2)),
        ({"mode": "bslongformer", "global_block_indices": [1], "attention": "unidirectional"},
         BSLongformerSparsityConfig(4, global_block_indices=(1,), attention=UNI)),
        ({"mode": "local", "num_sliding_window_blocks": 7},
         LocalSlidingWindowSparsityConfig(4, num_sliding_window_blocks=7)),
    ],
)
def test_config_from_dict(block, expected):
    config = sparsity_config_from_dict(block, num_heads=4)
    assert isinstance(config, SparsityConfig)
    assert config == expected
    np.testing.assert_array_equal(config.make_layout(256), expected.make_layout(256))


@pytest.mark.parametrize(
    "block, match",
    [
        ({"mode": "longformer"},
         r"sparse_attention.mode: got 'longformer'; accepted values are "
         r"\['dense', 'fixed', 'variable', 'bigbird', 'bslongformer', 'local'\]"),
        ({"mode": "fixed", "num_local_block": 4},
         r"sparse_attention.num_local_block: unknown key for mode 'fixed' \(did you mean "
         r"'num_local_blocks'\?\); accepted keys are \['mode', 'block', .*'num_local_blocks'"),
        ({"mode": "local", "different_layout_per_head": True},
         r"unknown key for mode 'local'; accepted keys are "
         r"\['mode', 'block', 'num_sliding_window_blocks', 'attention'\]"),
        ({"mode": "dense", "seed": 1}, r"sparse_attention.seed: unknown key for mode 'dense'"),
        ({"num_heads": 8}, r"sparse_attention.num_heads: got 8, but the model has 4 heads"),
        ({"mode": "fixed", "num_local_blocks": 3, "num_global_blocks": 2},
         r"sparse_attention \(mode 'fixed'\): FixedSparsityConfig: num_global_blocks=2 is invalid"),
        (["fixed"], r"sparse_attention: expected a mapping"),
    ],
)
def test_config_from_dict_errors(block, match):
    with pytest.raises(ConfigError, match=match):
        sparsity_config_from_dict(block, num_heads=4)


def test_config_from_dict_names_the_path():
    with pytest.raises(ConfigError, match=r"^model.sparse_attention.mode: got 'x'"):
        sparsity_config_from_dict({"mode": "x"}, num_heads=2, path="model.sparse_attention")
