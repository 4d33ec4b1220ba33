"""Multi-step FedAvg: client simulation, victim classifiers, and (coming) IG/SME/NL-SME."""
