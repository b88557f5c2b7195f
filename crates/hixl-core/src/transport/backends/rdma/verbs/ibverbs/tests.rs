use std::mem::{offset_of, size_of};

use super::*;
use crate::error::Status;

#[test]
fn a_missing_library_is_unsupported_and_names_itself() {
    // SAFETY: no such library exists: nothing is loaded.
    let e = unsafe { LibVerbs::load_from("libhixl-no-such-ibverbs.so.1") }.err().expect("no such library");
    assert_eq!(e.status, Status::Unsupported);
    assert!(
        e.message.contains("libhixl-no-such-ibverbs.so.1") && e.message.contains("cannot be loaded"),
        "{e}"
    );
}

/// The installed `<infiniband/verbs.h>` (or the one under `HIXL_IBVERBS_INCLUDE`), if any.
fn header_dir() -> Option<String> {
    let dir = std::env::var("HIXL_IBVERBS_INCLUDE").unwrap_or_else(|_| "/usr/include".into());
    std::path::Path::new(&dir).join("infiniband/verbs.h").exists().then_some(dir)
}

/// Sizes and offsets as a C compiler sees them with the real header, against ours. Runs where
/// the header and `cc` are installed (CI installs libibverbs-dev and sets
/// HIXL_REQUIRE_IBVERBS_HEADER=1, which makes their absence a failure).
#[test]
fn layout_matches_the_installed_header() {
    let required = std::env::var("HIXL_REQUIRE_IBVERBS_HEADER").is_ok_and(|v| v == "1");
    let Some(inc) = header_dir() else {
        assert!(!required, "HIXL_REQUIRE_IBVERBS_HEADER=1 but no infiniband/verbs.h was found");
        eprintln!("skipped: no infiniband/verbs.h (install libibverbs-dev)");
        return;
    };
    let checks: Vec<(&str, usize)> = vec![
        ("sizeof(struct ibv_sge)", size_of::<IbvSge>()),
        ("sizeof(struct ibv_send_wr)", size_of::<IbvSendWr>()),
        ("offsetof(struct ibv_send_wr, sg_list)", offset_of!(IbvSendWr, sg_list)),
        ("offsetof(struct ibv_send_wr, num_sge)", offset_of!(IbvSendWr, num_sge)),
        ("offsetof(struct ibv_send_wr, opcode)", offset_of!(IbvSendWr, opcode)),
        ("offsetof(struct ibv_send_wr, send_flags)", offset_of!(IbvSendWr, send_flags)),
        ("offsetof(struct ibv_send_wr, wr.rdma.remote_addr)", offset_of!(IbvSendWr, remote_addr)),
        ("offsetof(struct ibv_send_wr, wr.rdma.rkey)", offset_of!(IbvSendWr, rkey)),
        ("offsetof(struct ibv_send_wr, qp_type)", offset_of!(IbvSendWr, remote_srqn)),
        ("sizeof(struct ibv_wc)", size_of::<IbvWc>()),
        ("offsetof(struct ibv_wc, status)", offset_of!(IbvWc, status)),
        ("offsetof(struct ibv_wc, vendor_err)", offset_of!(IbvWc, vendor_err)),
        ("offsetof(struct ibv_wc, qp_num)", offset_of!(IbvWc, qp_num)),
        ("sizeof(struct ibv_qp_init_attr)", size_of::<IbvQpInitAttr>()),
        ("offsetof(struct ibv_qp_init_attr, cap)", offset_of!(IbvQpInitAttr, cap)),
        ("offsetof(struct ibv_qp_init_attr, qp_type)", offset_of!(IbvQpInitAttr, qp_type)),
        ("sizeof(struct ibv_qp_attr)", size_of::<IbvQpAttr>()),
        ("offsetof(struct ibv_qp_attr, dest_qp_num)", offset_of!(IbvQpAttr, dest_qp_num)),
        ("offsetof(struct ibv_qp_attr, ah_attr)", offset_of!(IbvQpAttr, ah_attr)),
        (
            "offsetof(struct ibv_qp_attr, ah_attr.is_global)",
            offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, is_global),
        ),
        (
            "offsetof(struct ibv_qp_attr, ah_attr.port_num)",
            offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, port_num),
        ),
        (
            "offsetof(struct ibv_qp_attr, ah_attr.grh.sgid_index)",
            offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvGlobalRoute, sgid_index),
        ),
        ("offsetof(struct ibv_qp_attr, pkey_index)", offset_of!(IbvQpAttr, pkey_index)),
        ("offsetof(struct ibv_qp_attr, max_rd_atomic)", offset_of!(IbvQpAttr, max_rd_atomic)),
        ("offsetof(struct ibv_qp_attr, timeout)", offset_of!(IbvQpAttr, timeout)),
        ("offsetof(struct ibv_qp_attr, rate_limit)", offset_of!(IbvQpAttr, rate_limit)),
        ("offsetof(struct ibv_context, ops.poll_cq)", offsets::CTX_POLL_CQ),
        ("offsetof(struct ibv_context, ops.req_notify_cq)", offsets::CTX_REQ_NOTIFY_CQ),
        ("offsetof(struct ibv_context, ops.post_send)", offsets::CTX_POST_SEND),
        ("offsetof(struct ibv_cq, context)", 0),
        ("offsetof(struct ibv_qp, context)", 0),
        ("offsetof(struct ibv_qp, qp_num)", offsets::QP_NUM),
        ("offsetof(struct ibv_mr, lkey)", offsets::MR_LKEY),
        ("sizeof(struct ibv_device_attr) <= 512", 1),
        ("offsetof(struct ibv_device_attr, max_mr_size)", offsets::DEV_MAX_MR_SIZE),
        ("offsetof(struct ibv_device_attr, max_qp)", offsets::DEV_MAX_QP),
        ("offsetof(struct ibv_device_attr, max_qp_wr)", offsets::DEV_MAX_QP_WR),
        ("offsetof(struct ibv_device_attr, max_sge)", offsets::DEV_MAX_SGE),
        ("offsetof(struct ibv_device_attr, max_sge_rd)", offsets::DEV_MAX_SGE_RD),
        ("offsetof(struct ibv_device_attr, max_cq)", offsets::DEV_MAX_CQ),
        ("offsetof(struct ibv_device_attr, max_cqe)", offsets::DEV_MAX_CQE),
        ("offsetof(struct ibv_device_attr, max_qp_rd_atom)", offsets::DEV_MAX_QP_RD_ATOM),
        ("offsetof(struct ibv_device_attr, max_qp_init_rd_atom)", offsets::DEV_MAX_QP_INIT_RD_ATOM),
        ("offsetof(struct ibv_mr, rkey)", offsets::MR_RKEY),
        ("offsetof(struct ibv_comp_channel, fd)", offsets::CHANNEL_FD),
        ("offsetof(struct ibv_port_attr, state)", offsets::PORT_STATE),
        ("offsetof(struct ibv_port_attr, active_mtu)", offsets::PORT_ACTIVE_MTU),
        ("offsetof(struct ibv_port_attr, gid_tbl_len)", offsets::PORT_GID_TBL_LEN),
        ("offsetof(struct ibv_port_attr, max_msg_sz)", offsets::PORT_MAX_MSG_SZ),
        ("offsetof(struct ibv_port_attr, lid)", offsets::PORT_LID),
        ("offsetof(struct ibv_port_attr, link_layer)", offsets::PORT_LINK_LAYER),
        ("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE as usize),
        ("IBV_WR_RDMA_READ", IBV_WR_RDMA_READ as usize),
        ("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED as usize),
        ("IBV_SEND_INLINE", IBV_SEND_INLINE as usize),
        ("IBV_QPT_RC", IBV_QPT_RC as usize),
        ("IBV_QPS_ERR", QPS_ERR as usize),
        ("IBV_QP_DEST_QPN", mask::DEST_QPN as usize),
        ("IBV_QP_MAX_DEST_RD_ATOMIC", mask::MAX_DEST_RD_ATOMIC as usize),
        ("IBV_QP_SQ_PSN", mask::SQ_PSN as usize),
        ("IBV_WC_REM_ACCESS_ERR", crate::transport::backends::rdma::verbs::wc::REM_ACCESS_ERR as usize),
        ("IBV_WC_RETRY_EXC_ERR", crate::transport::backends::rdma::verbs::wc::RETRY_EXC_ERR as usize),
        ("IBV_WC_WR_FLUSH_ERR", crate::transport::backends::rdma::verbs::wc::WR_FLUSH_ERR as usize),
        ("IBV_ACCESS_REMOTE_READ", crate::transport::backends::rdma::verbs::access::REMOTE_READ as usize),
        ("IBV_PORT_ACTIVE", crate::transport::backends::rdma::verbs::PORT_ACTIVE as usize),
    ];
    let dir = std::env::temp_dir().join(format!("hixl-ibv-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    for (expr, _) in &checks {
        c.push_str(&format!("  printf(\"%zu\\n\", (size_t)({expr}));\n"));
    }
    c.push_str("  return 0;\n}\n");
    std::fs::write(dir.join("layout.c"), c).unwrap();
    let exe = dir.join("layout");
    let cc = std::process::Command::new("cc")
        .arg(format!("-I{inc}"))
        .arg(dir.join("layout.c"))
        .arg("-o")
        .arg(&exe)
        .output();
    let cc = match cc {
        Ok(o) => o,
        Err(e) => {
            assert!(!required, "no C compiler: {e}");
            eprintln!("skipped: no C compiler ({e})");
            return;
        }
    };
    assert!(
        cc.status.success(),
        "compiling the layout probe failed: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = std::process::Command::new(&exe).output().unwrap();
    let got: Vec<usize> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().unwrap()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    let wrong: Vec<String> = checks
        .iter()
        .zip(&got)
        .filter(|((_, ours), c)| ours != *c)
        .map(|((expr, ours), c)| format!("{expr}: C says {c}, hixl has {ours}"))
        .collect();
    assert_eq!(got.len(), checks.len());
    assert!(wrong.is_empty(), "layouts differ from {inc}/infiniband/verbs.h:\n{}", wrong.join("\n"));
}

/// With the library present (HIXL_TEST_LIBIBVERBS names it, or the system has it), every
/// symbol resolves, and on a machine without RDMA the device list is empty or an error, never
/// a crash.
#[test]
fn the_real_library_loads_where_present() {
    let name = std::env::var("HIXL_TEST_LIBIBVERBS").unwrap_or_else(|_| LIBRARY.into());
    // SAFETY: the system's libibverbs, or the one HIXL_TEST_LIBIBVERBS names for this test.
    match unsafe { LibVerbs::load_from(&name) } {
        Err(e) => {
            assert_eq!(e.status, Status::Unsupported, "{e}");
            eprintln!("library not present: {e}");
        }
        Ok(v) => {
            let list = v.get_device_list();
            eprintln!("{name}: devices {list:?}");
            if let Ok(names) = list {
                for n in names {
                    assert!(!n.is_empty());
                }
            }
        }
    }
}

/// `ibv_reg_dmabuf_mr` is optional: the installed libibverbs has it exactly when its header
/// declares it (rdma-core >= 34), and a library without it is named as lacking it.
#[test]
fn the_dmabuf_symbol_resolves_where_rdma_core_has_it() {
    let Ok(v) = LibVerbs::load() else {
        eprintln!("skipped: no {LIBRARY}");
        return;
    };
    let declared = header_dir().map(|d| {
        std::fs::read_to_string(std::path::Path::new(&d).join("infiniband/verbs.h"))
            .unwrap()
            .contains("ibv_reg_dmabuf_mr(")
    });
    match (declared, v.gpu_dmabuf()) {
        (Some(true), r) => assert_eq!(r, Ok(()), "the header declares ibv_reg_dmabuf_mr"),
        (Some(false), r) => assert!(r.unwrap_err().contains("ibv_reg_dmabuf_mr")),
        (None, r) => eprintln!("no header to compare with; ibv_reg_dmabuf_mr: {r:?}"),
    }
    // libc is a real shared object without the symbol.
    // SAFETY: dlopen of libc with a NUL-terminated name (already loaded; never closed).
    let libc_h = unsafe { libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!libc_h.is_null());
    // SAFETY: a live handle.
    let e = unsafe { dmabuf::resolve(libc_h, "libc.so.6") }.expect_err("libc has no ibv_reg_dmabuf_mr");
    assert!(e.contains("libc.so.6 has no ibv_reg_dmabuf_mr") && e.contains("rdma-core >= 34"), "{e}");
}
