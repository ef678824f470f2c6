"""The names of the preference-loss family (posttrain.core.preference) and the groups config checks use:
plain data, importable without torch (posttrain.stages.config, the run form)."""

from __future__ import annotations

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
                  "aot", "aot_pair", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft",
                  "orpo", "kto")
REFERENCE_FREE_LOSSES = ("simpo", "orpo", "sft")  # need no reference log-probs
SMOOTHED_LOSSES = ("sigmoid", "robust", "simpo", "exo_pair", "aot", "aot_pair", "aot_unpaired")  # read label_smoothing
SORTING_LOSSES = ("aot", "aot_pair", "aot_unpaired")  # sort over the batch: no per-pair weights
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Losses built on the chosen-minus-rejected score alone, where f-DPO's log Z(x) term cancels
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
