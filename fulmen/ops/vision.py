"""Pooling and unpooling, upsampling, sampling grids, pixel shuffles and instance norm, with eager's grads
(`eager_grads`). `F.interpolate`, `F.max_pool2d`, `F.grid_sample` and the like are torch's Python: they run inline
(fulmen/acquisition/torch_python.py) and reach these ops.

`F.fractional_max_pool2d/3d` draw their pooling regions with `torch.rand` in that Python (unless `_random_samples` is
given), which is traced as a draw of its own: the pooling op takes the samples as an input, so recomputing it for the
backward draws nothing, and the draw consumes the RNG as eager's does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fulmen.ops.rules.eager import eager_op, nn_op

for _fn in (F.pixel_shuffle, F.pixel_unshuffle, F.channel_shuffle, F.avg_pool1d, F.adaptive_avg_pool1d,
            torch.adaptive_max_pool1d, torch.max_pool1d, torch.max_pool2d, torch.max_pool3d,
            torch.max_pool1d_with_indices, torch.grid_sampler, torch.affine_grid_generator):
    eager_op(_fn)

for _name in ("avg_pool2d", "avg_pool3d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
              "adaptive_max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices", "upsample_nearest1d",
              "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
              "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
              "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "max_unpool2d",
              "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d"):
    nn_op(_name)


def _instance_norm_refusal(x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                           use_input_stats: bool, *rest: Any) -> str | None:
    if use_input_stats and (running_mean is not None or running_var is not None):
        return ("fulmen cannot trace instance_norm updating running statistics (InstanceNorm with "
                "track_running_stats=True in training): the update is made in place by the op itself; use "
                "track_running_stats=False, or keep the module outside the jitted function")
    return None


eager_op(torch.instance_norm, refuse=_instance_norm_refusal)
