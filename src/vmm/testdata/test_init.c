/* A stand-in guest /init for the vmm tests (built with `gcc -static` by the tests).
 *
 * - kernel cmdline has `tryboxi.probe=1`: print TRYBOXI_PROBE_OK and power off, like the real
 *   agent does for the KVM probe;
 * - `tryboxi.hostname=exit...`: exit at once (PID 1 exiting panics the kernel: QEMU exits);
 * - otherwise print TRYBOXI_TEST_READY and sleep forever, like an idle agent.
 */
#include <fcntl.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <unistd.h>

static void say(int fd, const char *s) { (void)!write(fd, s, strlen(s)); }

int main(void) {
    char cmdline[4096] = {0};
    int con = open("/dev/console", O_WRONLY);
    mount("proc", "/proc", "proc", 0, 0);
    int fd = open("/proc/cmdline", O_RDONLY);
    if (fd >= 0) {
        (void)!read(fd, cmdline, sizeof cmdline - 1);
        close(fd);
    }
    if (strstr(cmdline, "tryboxi.probe=1")) {
        say(con, "TRYBOXI_PROBE_OK\n");
        sync();
        reboot(RB_POWER_OFF);
    }
    if (strstr(cmdline, "tryboxi.hostname=exit")) {
        say(con, "TRYBOXI_TEST_EXIT\n");
        return 1;
    }
    say(con, "TRYBOXI_TEST_READY\n");
    for (;;) pause();
}
