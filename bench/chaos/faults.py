"""The chaos soaks' fault machinery, shared by chaos.py (DDP with checkpoints)
and chaos_ft.py (fault-tolerant replica groups): nodes in network namespaces
on a bridge, whose links can be cut, and a small tmpfs that can be filled.
Both need root and iproute2; without them `usable` is False and the soak
says what it cannot inject.
"""
import os
import subprocess


def sh(cmd):
    return subprocess.run(cmd, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


class Lan:
    """n namespaces on a bridge; node i at 10.77.1.<i+1>, its link `dteth0`. usable False without root/iproute2."""

    def __init__(self, n):
        tag = str(os.getpid() % 100000)
        self.bridge = "dtcbr" + tag
        self.names = []
        self.usable = sh(f"ip link add {self.bridge} type bridge") and sh(f"ip link set {self.bridge} up")
        for i in range(n):
            if not self.usable:
                break
            ns, inside, outside = f"dtchaos{i}_{tag}", f"dtc{i}i{tag}", f"dtc{i}o{tag}"
            self.names.append(ns)
            self.usable = all(sh(c) for c in [
                f"ip netns add {ns}", f"ip link add {inside} type veth peer name {outside}",
                f"ip link set {inside} netns {ns}", f"ip link set {outside} master {self.bridge}",
                f"ip link set {outside} up", f"ip -n {ns} link set {inside} name dteth0",
                f"ip -n {ns} addr add {self.address(i)}/24 dev dteth0", f"ip -n {ns} link set dteth0 up",
                f"ip -n {ns} link set lo up"])

    def address(self, i):
        return f"10.77.1.{i + 1}" if self.names else "127.0.0.1"

    def wrap(self, i, own_shm=False):
        """The command prefix that runs a program as node i. With own_shm the node also gets a
        /dev/shm of its own (in the mount namespace `ip netns exec` makes), as a separate host
        has: dtrain's shared-memory transport then sees another host and its peers on other
        nodes talk over the network (Gloo on dteth0), which a link cut cuts."""
        if not self.usable:
            return []
        prefix = ["ip", "netns", "exec", self.names[i]]
        if own_shm:
            prefix += ["sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
        return prefix

    def cut(self, i):
        return sh(f"ip -n {self.names[i]} link set dteth0 down")

    def mend(self, i):
        return sh(f"ip -n {self.names[i]} link set dteth0 up")

    def close(self):
        for ns in self.names:
            sh(f"ip netns del {ns}")
        sh(f"ip link del {self.bridge}")


class SmallDisk:
    """A tmpfs of `mb` MiB mounted at `path` (made if missing), for a full disk on demand.
    usable False without root."""

    def __init__(self, path, mb):
        os.makedirs(path, exist_ok=True)
        self.path, self.mb = path, mb
        self.usable = sh(f"mount -t tmpfs -o size={mb}m tmpfs {path}")

    def fill(self):
        sh(f"dd if=/dev/zero of={self.path}/filler bs=1M count={self.mb * 2}")

    def free(self):
        try:
            os.remove(os.path.join(self.path, "filler"))
        except FileNotFoundError:
            pass

    def close(self):
        if self.usable:
            sh(f"umount {self.path}")
