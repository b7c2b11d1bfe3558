################################################################################
# S3 bucket for models, data and checkpoints: private, encrypted, versioned
################################################################################

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Server access logs would need a second bucket per deployment; CloudTrail data events cover audits where required.
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles the cost of multi-GB checkpoints; versioning protects against overwrites and deletes.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket event notifications; the training driver polls its own checkpoints.
  bucket        = var.bucket_name
  bucket_prefix = var.bucket_name == null ? "${local.cluster_name}-" : null
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

# SSE-KMS with the AWS-managed aws/s3 key: encrypted at rest, and the IRSA role needs no KMS
# permissions, so its policy names nothing but this bucket.
resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "aws:kms"
    }
    bucket_key_enabled = true
  }
}

locals {
  # Where make deploy's runs go by default (scripts/deploy.sh: OUTPUT=s3://<bucket>/runs/...).
  runs_prefix = "runs/"
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {
      prefix = ""
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  rule {
    id     = "expire-overwritten-versions"
    status = "Enabled"

    filter {
      prefix = ""
    }

    noncurrent_version_expiration {
      noncurrent_days = 30
    }
  }

  # The runs (make deploy's OUTPUT, s3://<bucket>/runs/<release>-<class>) prune their checkpoints
  # every few minutes (<output>/checkpoints/step-NNNNNN/, keep_checkpoints newest): kept 30 days
  # as noncurrent versions, the pruned ones would add up to terabytes for a 70B model. S3 filters
  # take no wildcard (runs/*/checkpoints/), so the rule covers the whole runs/ prefix; where two
  # rules overlap, S3 honours the shorter expiration. The delete markers the pruning leaves go
  # too, once the versions under them have.
  rule {
    id     = "expire-pruned-run-checkpoints"
    status = "Enabled"

    filter {
      prefix = local.runs_prefix
    }

    # how long an overwritten run can be recovered: var.run_noncurrent_version_days (default 7)
    noncurrent_version_expiration {
      noncurrent_days = var.run_noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

################################################################################
# IRSA role: the chart's ServiceAccount, and only it, may read and write the bucket
################################################################################

data "aws_iam_policy_document" "irsa_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [aws_iam_openid_connect_provider.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.kubernetes_namespace}:${var.service_account_name}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

# Scope: the bucket (listing) and the objects in it; no other resource, no s3:* wildcard.
data "aws_iam_policy_document" "irsa" {
  statement {
    sid       = "ListBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid       = "ReadWriteObjects"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = ["${aws_s3_bucket.this.arn}/*"]
  }
}

resource "aws_iam_role" "irsa" {
  name_prefix        = "${local.cluster_name}-irsa-"
  assume_role_policy = data.aws_iam_policy_document.irsa_assume.json
}

resource "aws_iam_role_policy" "irsa" {
  name   = "bucket-access"
  role   = aws_iam_role.irsa.id
  policy = data.aws_iam_policy_document.irsa.json
}

################################################################################
# ECR repository for the appliance image (make deploy builds and pushes it)
################################################################################

resource "aws_ecr_repository" "this" {
  name                 = local.cluster_name
  image_tag_mutability = "IMMUTABLE"
  force_delete         = true # images can be rebuilt: destroy never stops at them

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }
}

resource "aws_ecr_lifecycle_policy" "this" {
  repository = aws_ecr_repository.this.name

  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Keep the 10 newest images"
      selection    = { tagStatus = "any", countType = "imageCountMoreThan", countNumber = 10 }
      action       = { type = "expire" }
    }]
  })
}
