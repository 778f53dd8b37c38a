"""What runs on one rank: the training loop (:mod:`~ddpkit.train.engine`) and what it asks, the DDP wrap,
the task (loss and metrics), evaluation, the optimizer and schedule, SyncBatchNorm, the stop signal, and the
worker functions the launcher starts (:mod:`~ddpkit.train.workers`)."""
