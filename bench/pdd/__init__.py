"""The live PDD benchmark (`make bench`): IDC-PD, CDC-PD and PDD on real agents."""
