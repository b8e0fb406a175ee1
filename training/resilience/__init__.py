"""What keeps a run alive on a shared cluster, or stops it cleanly: failures that end every rank together
(``all_ranks``), signals and timed saves (``preemption``), named hangs (``hang``), one run per output_dir
(``run_lock``), the master port (``ports``) and the DeepSpeed op build watched before the process group
(``op_build_watch``)."""
