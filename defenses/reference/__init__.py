"""The reference pair: membership inference on digits against output defenses.

It proves the harness end to end before the six packages lean on it: a
loss-threshold and a label-only membership-inference attack (Yeom et al., 2018;
Choquette-Choo et al., 2021) against a small MLP, with rounding and label-only
outputs as defenses (cf. IBM ART's ``Rounded`` and ``ClassLabels``).
"""
