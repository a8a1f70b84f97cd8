"""Where gpunode looks on every node: detection, the agent config and the CDI spec name these,
and so does the CPU node's boot (pipeline/shortcut.py); the node lock's sweep names the kubelet
drop-in without importing registration."""

SYSFS_PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR_ID = "10de"
DEFAULT_CONFIG_PATH = "/etc/gpunode/config.toml"
CDI_SPEC_PATH = "/var/run/cdi/nvidia.yaml"  # in CDI's and containerd's default spec dirs
KUBELET_DROPIN = "/etc/systemd/system/kubelet.service.d/20-gpunode-registration.conf"
TEMP_SUFFIX = ".gpunode-tmp"  # of every temporary gpunode makes (nodelock.sweep removes them)
