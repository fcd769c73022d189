"""Other engines measured by the same harness on the same workload."""
