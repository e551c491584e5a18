"""LossConfig: defaults resolve, every invalid setting raises ValueError naming its field."""

import pytest

from redline.kernels.loss_config import LossConfig


def test_eps_clip_high_defaults_to_eps_clip():
    assert LossConfig(eps_clip=0.3).eps_clip_high == 0.3


def test_explicit_eps_clip_high_is_kept():
    assert LossConfig(eps_clip=0.2, eps_clip_high=0.28).eps_clip_high == 0.28


@pytest.mark.parametrize("kwargs,field", [
    (dict(estimator="grpo"), "estimator"),
    (dict(estimator="cispo"), "eps_clip_high"),
    (dict(eps_clip=-0.1), "eps_clip"),
    (dict(eps_clip=float("nan")), "eps_clip"),
    (dict(eps_clip_high=-0.1), "eps_clip_high"),
    (dict(eps_clip_c=1.0), "eps_clip_c"),
    (dict(estimator="cispo", eps_clip_high=5.0, eps_clip_c=3.0), "eps_clip_c"),
    (dict(kl_type="kl"), "kl_type"),
    (dict(kl_coef="0.1"), "kl_coef"),
    (dict(entropy_coef=float("inf")), "entropy_coef"),
    (dict(tis="clip"), "tis"),
    (dict(tis="icepop", tis_clip=None), "tis_clip"),
    (dict(tis="icepop", tis_clip_low=None), "tis_clip_low"),
    (dict(tis="truncate", tis_clip_low=-1.0), "tis_clip_low"),
    (dict(tis="truncate", tis_clip_low=3.0, tis_clip=2.0), "tis_clip"),
    (dict(agg="mean"), "agg"),
    (dict(agg="seq-mean-token-sum-norm"), "agg_constant"),
    (dict(agg="seq-mean-token-sum-norm", agg_constant=0.0), "agg_constant"),
    (dict(agg="token-mean", agg_constant=4.0), "agg_constant"),
])
def test_invalid_setting_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        LossConfig(**kwargs)
