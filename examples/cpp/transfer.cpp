// examples/cpp/transfer.cpp: the C example's two processes with the RAII wrapper, linked
// statically (libhixl.a): the target registers "kv"; the initiator WRITEs, READs back,
// compares, and sends "done" with a checksum that the target checks against its own bytes.
//   c++ -std=c++17 -I crates/hixl-c/include -I examples/cpp examples/cpp/transfer.cpp
//       PREFIX/lib/libhixl.a -lpthread -ldl -lm -o transfer_cpp && ./transfer_cpp
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>

#include "hixl.hpp"

static std::string checksum(const std::vector<uint8_t> &b) {
    uint64_t h = 1469598103934665603ull;
    for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
    return std::to_string(h);
}

int main() {
    const size_t size = 1 << 20;
    int fds[2];
    if (pipe(fds) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {  // target
        try {
            hixl::Engine t("127.0.0.1:0");
            std::vector<uint8_t> kv(size, 0);
            auto reg = t.register_mem(kv.data(), kv.size(), "kv");
            std::string me = t.local_engine();
            if (write(fds[1], me.c_str(), me.size() + 1) < 0) _exit(1);
            std::string want = t.wait_notify("done", 30000);
            _exit(want == checksum(kv) ? 0 : 2);
        } catch (const hixl::Error &e) {
            std::cerr << "target: " << e.what() << "\n";
            _exit(1);
        }
    }
    char remote[128] = {0};
    if (read(fds[0], remote, sizeof remote - 1) <= 0) return 1;
    try {
        hixl::Engine e("127.0.0.1");
        std::vector<uint8_t> src(size), back(size, 0);
        std::iota(src.begin(), src.end(), uint8_t(5));
        auto rs = e.register_mem(src.data(), size, nullptr, HIXL_ACCESS_R);
        auto rb = e.register_mem(back.data(), size);
        e.connect(remote, 10000);
        HixlRemoteRegion kv = e.remote_region(remote, "kv");
        std::vector<HixlDesc> d;
        for (size_t off = 0; off < size; off += 65536)
            d.push_back({reinterpret_cast<uintptr_t>(src.data()) + off, kv.addr + off, 65536});
        e.transfer_async(remote, HIXL_WRITE, d).wait();
        e.get(remote, back.data(), kv.addr, size);
        if (back != src) throw std::runtime_error("read back differs");
        e.send_notify(remote, "done", checksum(src));
    } catch (const std::exception &ex) {
        std::cerr << "initiator: " << ex.what() << "\n";
        return 1;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::cerr << "the target failed (" << status << ")\n";
        return 1;
    }
    std::printf("ok: %zu bytes written, read back and verified by both processes (C++)\n", size);
    return 0;
}
