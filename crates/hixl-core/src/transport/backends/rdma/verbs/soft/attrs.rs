//! The soft devices' names and limits: how many the provider offers ([`DEVICES_ENV`]) and
//! what `ibv_query_device` answers for them ([`LIMITS_ENV`]).

use super::fault;
use crate::error::{Error, Result};
use crate::transport::backends::rdma::verbs::DeviceAttr;

/// The name of the provider's first device (`soft1`, ... follow it; see [`DEVICES_ENV`]).
pub const DEVICE: &str = "soft0";
/// Environment variable: how many devices the provider offers (1 to 8; unset: 1), named
/// `soft0`, `soft1`, ..., each with its own GID and socket: the rails of multi-rail tests.
pub const DEVICES_ENV: &str = "HIXL_SOFT_RDMA_DEVICES";

/// The device names the provider offers (see [`DEVICES_ENV`]).
pub(super) fn device_names() -> Result<Vec<String>> {
    let n = match std::env::var(DEVICES_ENV) {
        Err(_) => 1,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=crate::wire::rdma::MAX_RAILS).contains(&n) => n,
            _ => {
                return Err(Error::param(format!(
                    "{DEVICES_ENV}={v:?} is invalid: expected 1 to {}",
                    crate::wire::rdma::MAX_RAILS
                )))
            }
        },
    };
    Ok((0..n).map(|i| format!("soft{i}")).collect())
}
/// Largest message of one work request (what `ibv_port_attr.max_msg_sz` says).
pub const MAX_MSG: u32 = 1 << 30;
/// The device's limits (`ibv_query_device`) unless [`LIMITS_ENV`] says otherwise: CQ entries
/// as rdma_rxe's (the smallest seen on a real stack), send-queue entries, SGEs, READs.
const MAX_CQE: i32 = 32767;
const MAX_QP_WR: i32 = 16384;
const MAX_SGE: i32 = 30;
const MAX_QP_RD_ATOM: i32 = 128;
/// Environment variable: other limits for the soft device, as `max_cqe=N,max_qp_wr=N,
/// max_sge=N,max_qp_rd_atom=N,max_qp_init_rd_atom=N` (any of them), so that tests can run the
/// backend on a device smaller than any real one, or give two processes different devices.
/// `max_qp_rd_atom` also sets `max_qp_init_rd_atom` unless that is given. The device enforces
/// them all: the READ depths as a NIC does (a QP asked for more is EINVAL; a responder QP sent
/// more READs at once than its `max_dest_rd_atomic` fails them and goes to ERR).
pub const LIMITS_ENV: &str = "HIXL_SOFT_RDMA_LIMITS";

/// The soft device's limits: the defaults above, changed by [`LIMITS_ENV`].
pub(super) fn device_attr() -> Result<DeviceAttr> {
    let mut d = DeviceAttr {
        max_mr_size: u64::MAX,
        max_qp: 1 << 16,
        max_qp_wr: MAX_QP_WR,
        max_sge: MAX_SGE,
        max_sge_rd: MAX_SGE,
        max_cq: 1 << 16,
        max_cqe: MAX_CQE,
        max_qp_rd_atom: MAX_QP_RD_ATOM,
        max_qp_init_rd_atom: MAX_QP_RD_ATOM,
    };
    fault::mute_after()?;
    let Ok(spec) = std::env::var(LIMITS_ENV) else { return Ok(d) };
    let mut init = None;
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = || {
            Error::param(format!(
                "{LIMITS_ENV}: {item:?} is not NAME=N (max_cqe, max_qp_wr, max_sge, max_qp_rd_atom, \
                 max_qp_init_rd_atom)"
            ))
        };
        let (k, v) = item.split_once('=').ok_or_else(bad)?;
        let v: i32 = v.trim().parse().map_err(|_| bad())?;
        match k.trim() {
            "max_cqe" => d.max_cqe = v,
            "max_qp_wr" => d.max_qp_wr = v,
            "max_sge" => (d.max_sge, d.max_sge_rd) = (v, v),
            "max_qp_rd_atom" => (d.max_qp_rd_atom, d.max_qp_init_rd_atom) = (v, v),
            "max_qp_init_rd_atom" => init = Some(v),
            _ => return Err(bad()),
        }
    }
    if let Some(v) = init {
        d.max_qp_init_rd_atom = v;
    }
    Ok(d)
}
