"""Fleet inventory and provisioning: datacenters, GPU types, prices, WAN links, nodes, instances."""
