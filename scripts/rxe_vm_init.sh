#!/bin/busybox sh
# PID 1 of the rxe VM (scripts/rxe_vm.sh puts it in the initramfs): loads the modules, mounts the
# host's root read-only with a writable /tmp, sets up the network and rxe, runs the command that
# the host wrote to $hixl_out/cmd.sh in a chroot, writes its output and status there, powers off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for a in $(cat /proc/cmdline); do
  case $a in hixl_*=*) eval "${a%%=*}='${a#*=}'" ;; esac
done
for m in $(cat /modules.order); do
  insmod "/mods/$m" 2>/dev/null || echo "rxe-vm: insmod $m failed"
done
o="trans=virtio,version=9p2000.L,msize=1048576"
mount -t 9p -o "$o,ro,cache=loose" host /host || { echo "rxe-vm: no 9p root"; poweroff -f; }
mount -t tmpfs -o size=75% tmp /ovl
mkdir -p /ovl/u /ovl/w
mount -t overlay overlay -o lowerdir=/host/tmp,upperdir=/ovl/u,workdir=/ovl/w /host/tmp
mount -t 9p -o "$o" out "/host$hixl_out"
[ -n "$hixl_keep" ] && mount -t 9p -o "$o" keep "/host$hixl_keep"
mount --bind /dev /host/dev
mount -t devpts devpts /host/dev/pts 2>/dev/null
mount -t tmpfs shm /host/dev/shm
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t tmpfs run /host/run
net() {
  chroot /host /bin/sh -ec "
    ip link set lo up
    if [ -e /sys/class/net/eth0 ]; then
      ip link set eth0 up; ip addr add $hixl_ip/24 dev eth0
      rdma link add rxe0 type rxe netdev eth0
    else
      i=0
      while [ \$i -lt ${hixl_rails:-1} ]; do
        ip link add v\$i type veth peer name w\$i
        ip link set v\$i up; ip link set w\$i up
        if [ \$i = 0 ]; then ip addr add $hixl_ip/24 dev v0; else ip addr add 10.77.\$i.1/24 dev v\$i; fi
        rdma link add rxe\$i type rxe netdev v\$i
        i=\$((i + 1))
      done
    fi"
}
net || echo "rxe-vm: network or rxe setup failed"
chroot /host /bin/bash -c "export HOME=/tmp HIXL_VM=1 HIXL_VM_IP=$hixl_ip HIXL_VM_OUT=$hixl_out; . $hixl_out/cmd.sh" >"/host$hixl_out/log" 2>&1
echo $? >"/host$hixl_out/rc"
sync
poweroff -f
