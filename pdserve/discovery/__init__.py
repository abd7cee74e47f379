"""Discovery backends: embedded (hosted by the router) and etcd."""
