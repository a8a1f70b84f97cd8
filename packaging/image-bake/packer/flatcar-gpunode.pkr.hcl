# A Flatcar GPU node image with gpunode baked in: Packer's QEMU builder boots Flatcar's own
# QEMU image, copies gpunode's sysext, the bake config and the agent config into it, and runs
# `gpunode image bake --root /` there (bake-in-vm.sh, with the bundled gpunode of the sysext:
# Flatcar has no Python). The output qcow2 boots into a node that downloads and builds
# nothing for its GPUs. Guide: docs/image-bake.md.
#
#   packer init packaging/image-bake/packer
#   packer build \
#     -var flatcar_version=4459.2.1 -var flatcar_image_checksum=sha512:<from the DIGESTS> \
#     -var gpunode_sysext=packaging/build/gpunode-0.1.0-x86-64.raw \
#     -var ssh_public_key="$(cat ~/.ssh/id_ed25519.pub)" \
#     -var ssh_private_key_file=~/.ssh/id_ed25519 \
#     packaging/image-bake/packer
#
# Not run in gpunode's tests (no Packer, no KVM there): tests/integration/test_image_pipeline.py
# parses this file as HCL2 and checks its references; bake-in-vm.sh itself runs there for real.

packer {
  required_plugins {
    qemu = {
      source  = "github.com/hashicorp/qemu"
      version = ">= 1.1.0"
    }
  }
}

variable "flatcar_channel" {
  type        = string
  default     = "stable"
  description = "Flatcar release channel (alpha, beta, stable, lts)."
}

variable "flatcar_version" {
  type        = string
  description = "Flatcar release, e.g. 4459.2.1: the driver sysext is baked for exactly this one."
}

variable "flatcar_image_checksum" {
  type        = string
  description = "sha512:<hex> of flatcar_production_qemu_image.img, from the release's .DIGESTS (check its signature)."
}

variable "gpunode_sysext" {
  type        = string
  description = "gpunode's system extension (make sysext: packaging/build/gpunode-<version>-x86-64.raw)."
}

variable "bake_config" {
  type        = string
  default     = "../bake.toml"
  description = "The bake config; its [gpunode] source names the sysext's file name (copied beside it)."
}

variable "agent_config" {
  type        = string
  default     = "../gpunode.toml"
  description = "The agent config the bake config's [agent] config names (copied beside it)."
}

variable "ssh_public_key" {
  type        = string
  description = "Authorized for the user core of the build machine only (the reset discards it)."
}

variable "ssh_private_key_file" {
  type = string
}

locals {
  staging = "/home/core/gpunode-bake"
  # The build machine's Ignition config, passed by QEMU's firmware config as Flatcar's QEMU
  # image reads it (flatcar/scripts build_library/qemu_template.sh: opt/org.flatcar-linux/config).
  builder_ignition = jsonencode({
    ignition = { version = "3.3.0" }
    passwd   = { users = [{ name = "core", sshAuthorizedKeys = [var.ssh_public_key] }] }
  })
}

source "qemu" "flatcar" {
  iso_url          = "https://${var.flatcar_channel}.release.flatcar-linux.net/amd64-usr/${var.flatcar_version}/flatcar_production_qemu_image.img"
  iso_checksum     = var.flatcar_image_checksum
  disk_image       = true
  format           = "qcow2"
  accelerator      = "kvm"
  headless         = true
  memory           = 2048
  cpus             = 2
  output_directory = "output-flatcar-gpunode-${var.flatcar_version}"
  vm_name          = "flatcar-gpunode-${var.flatcar_version}.qcow2"
  # qemu's option syntax doubles a comma inside a value.
  qemuargs = [
    ["-fw_cfg", "name=opt/org.flatcar-linux/config,string=${replace(local.builder_ignition, ",", ",,")}"],
  ]
  communicator         = "ssh"
  ssh_username         = "core"
  ssh_private_key_file = var.ssh_private_key_file
  ssh_timeout          = "10m"
  shutdown_command     = "sudo systemctl poweroff"
}

build {
  sources = ["source.qemu.flatcar"]

  provisioner "shell" {
    inline = ["mkdir -p ${local.staging}"]
  }

  provisioner "file" {
    sources     = [var.gpunode_sysext, var.bake_config, var.agent_config, "${path.root}/../bake-in-vm.sh"]
    destination = "${local.staging}/"
  }

  # The bake, then Flatcar's selective OS reset for the next boot (the node's first): the build
  # machine's state goes, Ignition runs again, the baked paths stay.
  provisioner "shell" {
    inline = [
      "sudo bash ${local.staging}/bake-in-vm.sh --config ${local.staging}/${basename(var.bake_config)} --gpunode-sysext ${local.staging}/${basename(var.gpunode_sysext)} --reset",
      "rm -rf ${local.staging}",
    ]
  }
}
