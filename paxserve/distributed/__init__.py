"""Several hosts: the cluster, its rendezvous, and a worker rank's loop."""
