"""Start-up: can this prefill rank stream layer-wise, and the session if so.

`SGLANG_MORI_LAYERWISE=on` on a deployment that cannot stream stops start-up with the reason;
`auto` logs it and stays chunk-wise (counted once as a `deployment` fallback). The same holds for a
decode registering later that the layer streams cannot serve (`layerwise_planner`).
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.backend.prefill.layerwise.session import LayerwiseSession
from sglang_mori.config import ConfigError

logger = logging.getLogger(__name__)


def unsupported_reason(deployment, layout) -> Optional[str]:
    """Why this deployment (sglang_fields.Deployment) cannot stream layer-wise, or None."""
    checks = (
        (deployment.pp_size > 1, "pipeline parallelism (a stage's forward is not the whole model)"),
        (deployment.attn_cp_size > 1, "context parallelism"),
        (deployment.staging, "the staging buffer (SGLANG_DISAGG_STAGING_BUFFER)"),
        (deployment.kv_shard_size > 1, "KV sharding across ranks"),
        (bool(layout.states), "hybrid state pools (mamba, SWA, DSA state)"),
        (deployment.two_batch_overlap, "two-batch overlap (a layer runs once per micro-batch)"),
    )
    return next((why for bad, why in checks if bad), None)


def layerwise_planner(mode: str, layout, local, kv_shard: tuple = (0, 1)) -> LayerwisePlanner:
    """The prefill planner under SGLANG_MORI_LAYERWISE=on|auto. `auto` serves every decode `off`
    serves (one the layer streams cannot pair goes chunk-wise); `on` refuses such a decode at
    registration, as it refuses a deployment that cannot stream at start-up."""
    return LayerwisePlanner(layout, local, kv_shard, refuse_unstreamable=mode == "on")


def build_session(deployment, kv_data_ptrs, parts, service, layout) -> Optional[LayerwiseSession]:
    cfg = parts.config
    if cfg.layerwise == "off":
        return None
    reason = unsupported_reason(deployment, layout)
    if reason is not None:
        if cfg.layerwise == "on":
            raise ConfigError(f"SGLANG_MORI_LAYERWISE=on: this deployment cannot stream layer-wise: {reason}; "
                              "use SGLANG_MORI_LAYERWISE=auto to send chunk-wise here")
        logger.warning("sglang-mori: SGLANG_MORI_LAYERWISE=auto: chunk-wise transfers, because of %s", reason)
        parts.metrics.layerwise_fallback("deployment")
        return None
    buffer_map = LayerBufferMap(list(kv_data_ptrs), layout.num_draft_entries, layout.is_mla)
    session = LayerwiseSession(parts, service, buffer_map, group_size=cfg.layerwise_group,
                               min_tokens=cfg.layerwise_min_tokens,
                               min_batch_tokens=cfg.layerwise_min_batch_tokens,
                               late_join=deployment.attn_tp_size == 1)
    logger.info("sglang-mori: layer-wise streaming on (%s, groups: %s, min %d new tokens per request, "
                "%d per batch; optimistic requests %s)", "MLA" if layout.is_mla else "MHA",
                f"{cfg.layerwise_group} layers" if cfg.layerwise_group else "halving",
                cfg.layerwise_min_tokens, cfg.layerwise_min_batch_tokens,
                "join mid-forward" if session.late_join else "go chunk-wise (attention TP > 1)")
    return session
