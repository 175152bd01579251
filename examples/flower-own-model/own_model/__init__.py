"""A user's Flower app: own CNN, own data, time-adaptive DP from defense-suite."""
