"""The MoE experts' metric families, read from `EngineStats.experts` at scrape time.

`expert_families` yields, for a MoE model: `sits:moe_expert_tokens_total{layer,expert}`,
`sits:moe_expert_anomalous_checks_total{layer,expert}`, `sits:moe_expert_frozen{layer,expert}`
(0/1), `sits:moe_expert_imbalance{layer}`, the freeze and restore counters, the spare slots
(`sits:moe_spare_slots{layer,state}`) and, with the load-aware placement,
`sits:moe_expert_placement_imbalance{when}` and `sits:moe_expert_replacements_total`
(see `sits.obs.server_metrics` for their meaning). Labels are bounded by the model's layers x
experts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def expert_families(experts, model_name: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The MoE expert metrics of an `ExpertStats` snapshot."""
    cell = ["model_name", "layer", "expert"]
    tokens = CounterMetricFamily(
        "sits:moe_expert_tokens", "Tokens routed to each MoE expert.", labels=cell
    )
    anomalous = CounterMetricFamily(
        "sits:moe_expert_anomalous_checks",
        "Health checks in which the expert gave non-finite outputs.",
        labels=cell,
    )
    frozen = GaugeMetricFamily(
        "sits:moe_expert_frozen", "1 while the router masks the expert.", labels=cell
    )
    imbalance = GaugeMetricFamily(
        "sits:moe_expert_imbalance",
        "Max over mean of the tokens routed per expert, per MoE layer.",
        labels=["model_name", "layer"],
    )
    for layer in experts.layers:
        label = str(layer.layer_id)
        imbalance.add_metric([model_name, label], layer.imbalance)
        for expert_id, num_tokens in enumerate(layer.num_tokens):
            cell_labels = [model_name, label, str(expert_id)]
            tokens.add_metric(cell_labels, float(num_tokens))
            anomalous.add_metric(cell_labels, float(layer.num_anomalous[expert_id]))
            frozen.add_metric(cell_labels, float(layer.frozen[expert_id]))
    alerts = CounterMetricFamily(
        "sits:moe_expert_auto_freezes",
        "Experts frozen by the health check (alert counter).",
        labels=["model_name"],
    )
    alerts.add_metric([model_name], float(experts.num_auto_freezes))
    yield from (tokens, anomalous, frozen, imbalance, alerts)
    yield from _spare_families(experts, model_name)
    yield from _placement_families(experts, model_name)


def _placement_families(
    experts, model_name: str
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The load-aware expert placement's figures; nothing with the static policy."""
    placement = getattr(experts, "placement", None)
    if placement is None:
        return
    imbalance = GaugeMetricFamily(
        "sits:moe_expert_placement_imbalance",
        "Max over mean rank load of the MoE experts at the last re-placement, on its window's "
        "tokens: before (the old placement) and after (the new one).",
        labels=["model_name", "when"],
    )
    imbalance.add_metric([model_name, "before"], placement.imbalance_before)
    imbalance.add_metric([model_name, "after"], placement.imbalance_after)
    replacements = CounterMetricFamily(
        "sits:moe_expert_replacements",
        "Re-placements of the MoE experts on the expert-parallel ranks.",
        labels=["model_name"],
    )
    replacements.add_metric([model_name], float(placement.num_replacements))
    yield from (imbalance, replacements)


def _spare_families(experts, model_name: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Restore counters and, with spare expert slots, the spare slots per layer."""
    restores = CounterMetricFamily(
        "sits:moe_expert_restores",
        "MoE experts reloaded from the checkpoint.",
        labels=["model_name"],
    )
    restores.add_metric([model_name], float(experts.num_restores))
    spare_restores = CounterMetricFamily(
        "sits:moe_expert_spare_restores",
        "MoE experts reloaded from the checkpoint into a spare slot.",
        labels=["model_name"],
    )
    spare_restores.add_metric([model_name], float(experts.num_spare_restores))
    yield from (restores, spare_restores)
    if experts.num_spare_experts == 0:
        return
    slots = GaugeMetricFamily(
        "sits:moe_spare_slots",
        "Spare expert slots per MoE layer: free (ready for a restore) and used (serving a "
        "restored expert).",
        labels=["model_name", "layer", "state"],
    )
    for layer in experts.layers:
        label = str(layer.layer_id)
        slots.add_metric([model_name, label, "free"], float(layer.num_free_slots))
        slots.add_metric([model_name, label, "used"], float(layer.num_relocated))
    yield slots
