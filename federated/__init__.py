"""Time-adaptive privacy spending in DP federated learning, on Flower and Opacus.

Kiani, Kulkarni, Dziedzic, Draper and Boenisch, "Differentially Private Federated
Learning with Time-Adaptive Privacy Spending", ICLR 2025. Clients with individual
budgets save privacy early (a lower Poisson sampling rate) and spend it later, under
one noise multiplier; every schedule is calibrated so that Opacus's accountant lands
within 1% below the client's budget.

Modules: :mod:`~federated.accounting` (Opacus RDP/PRV accounting and rate solvers),
:mod:`~federated.schedule` (uniform, time-adaptive, strict-only schedules),
:mod:`~federated.client` (local DP-SGD: numpy and Opacus backends),
:mod:`~federated.training` (the framework-free FedAvg loop),
:mod:`~federated.arms` (the method and its baselines as defenses),
:mod:`~federated.ledger` (a client's own privacy agreement and ledger),
:mod:`~federated.flower` (the client mod, strategy wrapper, training helper and the
package's own Flower app), :mod:`~federated.audit`
(canary audit), :mod:`~federated.scenario` (harness wiring). Flower and Opacus are
imported lazily, so importing this package needs neither.
"""

from defenses import __version__ as __version__
