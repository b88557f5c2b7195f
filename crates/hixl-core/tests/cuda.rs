//! CUDA device memory through the public API. On a machine without CUDA, registering device
//! memory must be UNSUPPORTED with a message that says CUDA was not found (and never panic);
//! on a machine with CUDA this test skips. The GPU tests are Python ones (`tests/test_cuda.py`,
//! `tests/test_cuda_staging.py`), which `scripts/gpu_check.sh` runs on a GPU machine.

use hixl_core::{Engine, MemDesc, MemType, Status};

fn engine() -> Engine {
    let e = Engine::new();
    e.initialize("127.0.0.1:0", &Default::default()).unwrap();
    e
}

#[test]
fn device_memory_without_cuda_is_unsupported_and_says_so() {
    let info = hixl_core::cuda_info();
    if info.available {
        eprintln!("skipped: this machine has CUDA ({} device(s))", info.devices.len());
        return;
    }
    assert!(info.reason.contains("CUDA was"), "{}", info.reason);
    let e = engine();
    for domain in [MemType::Device, MemType::Cuda(0), MemType::Cuda(3)] {
        // Any address: the driver is asked before the address is looked at.
        let err =
            unsafe { e.register_mem(MemDesc { addr: 0x7f00_0000_0000, len: 1 << 20 }, domain) }.unwrap_err();
        assert_eq!(err.status, Status::Unsupported, "{err}");
        assert!(
            err.message.contains("CUDA was not found") || err.message.contains("CUDA was found"),
            "{err}"
        );
        assert!(err.message.contains("libcuda.so.1"), "{err}");
    }
    // Host memory is untouched by any of this.
    let h = e.register_static(Box::leak(vec![0u8; 4096].into_boxed_slice()), "host").unwrap();
    assert_eq!(h.mem_type, MemType::Host);
    e.finalize().unwrap();
}

/// GPU memory on RDMA (GPUDirect) without a GPU: registering `cuda:0` memory on an engine whose
/// only backend is `rdma` is UNSUPPORTED and names what is missing: CUDA, and the rdma
/// backend's own reason (no RDMA device, or the GPUDirect pieces it lacks). Through the public
/// API, a real engine, with the soft provider (a device, but no GPU path) and the verbs one.
#[test]
fn cuda_memory_on_rdma_alone_without_a_gpu_names_what_is_missing() {
    if hixl_core::cuda_info().available {
        eprintln!("skipped: this machine has CUDA");
        return;
    }
    for provider in ["soft", "verbs"] {
        let opts = [("hixl.backends", "rdma"), ("hixl.rdma.provider", provider)]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let e = Engine::new();
        e.initialize("127.0.0.1:0", &opts).unwrap();
        for domain in [MemType::Cuda(0), MemType::Device] {
            let err = unsafe { e.register_mem(MemDesc { addr: 0x7f00_0000_0000, len: 1 << 20 }, domain) }
                .unwrap_err();
            let m = &err.message;
            eprintln!("{provider}, {domain:?}: {m}");
            assert_eq!(err.status, Status::Unsupported, "{err}");
            assert!(m.contains("CUDA was not found") || m.contains("CUDA was found"), "{m}");
            assert!(m.contains("served by no backend of hixl.backends=rdma"), "{m}");
            if provider == "soft" {
                assert!(m.contains("rdma: GPUDirect RDMA: missing:"), "{m}");
                assert!(m.contains("soft provider's reg_dmabuf_mr cannot reach GPU memory"), "{m}");
                assert!(m.contains("ibv_reg_mr on GPU memory needs a NIC's provider"), "{m}");
            } else {
                // No NIC here: the backend says so; with one, it names the GPUDirect pieces.
                assert!(
                    m.contains("rdma: RDMA is not usable here (verbs provider)")
                        || m.contains("rdma: GPUDirect RDMA: missing:"),
                    "{m}"
                );
            }
        }
        e.finalize().unwrap();
    }
}
